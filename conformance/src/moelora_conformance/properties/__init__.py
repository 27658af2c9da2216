"""The conformance properties (DESIGN.md §7): one module per property, collected by the
plugin (``pytest -p moelora_conformance.plugin --backend module:factory``).

Each property has a stable id (``P01``–``P14``, :data:`PROPERTIES`), the promise it checks (its
test function's name), and the harness modes it runs in; the plugin parametrizes it over those
modes and the profile's dtypes, and skips what the backend does not declare as "not implemented".
"""

from moelora_conformance.properties.registry import PROPERTIES, Property, conformance, property_of

__all__ = ["PROPERTIES", "Property", "conformance", "property_of"]
