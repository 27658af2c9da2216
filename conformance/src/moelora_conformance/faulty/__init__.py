"""Deliberately broken backends: the suite's own test subjects.

- :mod:`.mutants`: the reference backend with one known fault each (:data:`MUTANTS`); every one
  must be caught by the general properties.
- :mod:`.backend_mutants`: the ``triton`` and ``csgmv`` backends with one known fault each, added to
  :data:`MUTANTS` when ``moelora_backends`` is installed (each with its example budget).
- :mod:`.beyond_caps`: reference faults that only sizes past the ``interpret`` caps reach
  (:data:`CAP_MUTANTS`: top_k > 2, R > 16, H or I > 64); loadable like the others, not in ``MUTANTS``.
- :mod:`.e2e_mutants`: backend faults that show when an engine captures several graph buckets over one
  buffer set per family (:data:`E2E_MUTANTS`); the e2e suite must catch each one
  (``moelora-conformance mutations --engine``); loadable like the others, not in ``MUTANTS``.
- :mod:`.routing_faults`: DeepSeek-V3's routing faults, put into the readers or the engine (not
  backends: routing belongs to the caller); caught by hf-check, checkpoint-pass and the engine's
  comparison with HF + PEFT.

Load one as a backend with ``--backend moelora_conformance.faulty:<factory>`` (factories below, one
per mutation).
"""

import importlib.util

from moelora_conformance.faulty.beyond_caps import CAP_MUTANTS
from moelora_conformance.faulty.e2e_mutants import E2E_MUTANTS
from moelora_conformance.faulty.mutants import MUTANTS

if importlib.util.find_spec("moelora_backends") is not None:
    # The triton / csgmv mutants join once their backends are installed.
    from moelora_conformance.faulty.backend_mutants import BACKEND_MUTANTS

    MUTANTS.update(BACKEND_MUTANTS)


def _factory(name: str):
    cls = {**MUTANTS, **CAP_MUTANTS, **E2E_MUTANTS}[name]

    def make_backend(spec):
        return cls(spec)

    make_backend.__name__ = f"make_{name.replace('-', '_').lower()}"
    make_backend.__doc__ = f"Factory of the {name!r} mutant: {cls.__doc__.splitlines()[0]}"
    return make_backend


#: ``--backend moelora_conformance.faulty:<factory name>`` for each mutation.
FACTORIES = {name: _factory(name) for name in [*MUTANTS, *CAP_MUTANTS, *E2E_MUTANTS]}
globals().update({f.__name__: f for f in FACTORIES.values()})


def target(name: str) -> str:
    """The ``--backend`` string of mutation ``name``."""
    return f"moelora_conformance.faulty:{FACTORIES[name].__name__}"


__all__ = ["CAP_MUTANTS", "E2E_MUTANTS", "FACTORIES", "MUTANTS", "target", *(f.__name__ for f in FACTORIES.values())]
