"""Example backends written outside moelora's own packages, as a third party writes them (the suite
checks them like any other backend): :mod:`.torch_backend`."""
