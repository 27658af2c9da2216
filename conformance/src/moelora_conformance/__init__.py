"""moelora_conformance: strategies, profiles, fixtures, the pytest plugin and the report."""

__version__ = "0.1.0"
