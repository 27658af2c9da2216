"""Kernel-test setup: silence one known warning of the Triton interpreter.

Triton 3.6's interpreter turns 1-element numpy arrays into loop bounds with ``int(array)``, which
numpy >= 1.25 deprecates; it says nothing about our kernels and would bury real warnings.
"""


def pytest_configure(config):
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar is deprecated:DeprecationWarning",
    )
