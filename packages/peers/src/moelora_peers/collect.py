"""Import every module a peer's paths use, optionally as if on a CUDA device, and list the files loaded.

``python -m moelora_peers.collect PEER [--as-cuda MAJOR.MINOR]`` imports the peer's
``MODULES`` and ``LAZY_MODULES`` (``moelora_peers.sglang_modules`` / ``vllm_modules``) through its
finder in a fresh process and prints one JSON line: ``root``, ``version``, ``loaded`` (the peer
files, relative to ``root``). With ``--as-cuda`` the stubs' platform (``moelora_peers.stubs._platform``)
answers CUDA of that compute capability before any stub is imported, so the peers' ``if _is_cuda:``
import branches run here as on a GPU (no CUDA call is made: only imports). The GPU-folder builder
(``packages/peers/scripts/build_gpu_folder.py``) collects its files this way and checks the built
folder with it (``MOELORA_PEERS_ROOT``); ``test_every_module_imports_as_on_cuda`` runs it on the
installed releases. It catches what a CPU import cannot: a name a CUDA-only branch imports from a
package the loader serves as a shell (``RUN_INIT``), or a file the folder lacks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from moelora_core.errors import InvalidFieldError

PEERS = ("sglang", "vllm")


def import_all(peer: str) -> dict:
    """Import ``MODULES`` and ``LAZY_MODULES`` of ``peer`` through its finder.

    Returns:
        ``{"root": str, "version": str, "loaded": [str, ...]}`` (``PeerImporter``'s fields).

    Raises:
        InvalidFieldError: ``peer`` is not one of :data:`PEERS`.
        ImportError: a module of the peer does not import (the peer's own error).
    """
    if peer not in PEERS:
        raise InvalidFieldError("peer", f"{peer!r} is not one of {PEERS}")
    mods = importlib.import_module(f"moelora_peers.{peer}_modules")
    for short in mods.MODULES:
        mods.module(short)
    for name in mods.LAZY_MODULES:
        mods.import_peer(mods.importer(), name)
    imp = mods.importer()
    return {"root": str(imp.dist.root), "version": imp.dist.version, "loaded": list(imp.loaded)}


def force_cuda(capability: tuple[int, int]) -> None:
    """Make the stubs' platform answer CUDA of ``capability``; call before any stub or peer import.

    Raises:
        InvalidFieldError: a peer module was already imported (its platform answers are fixed).
    """
    early = sorted(m for m in sys.modules if m.partition(".")[0] in PEERS or m.startswith("moelora_peers.stubs."))
    if early:
        raise InvalidFieldError("as_cuda", f"modules imported before the platform was forced: {early[:3]}")
    from moelora_peers.stubs import _platform

    _platform.cuda_capability = lambda: capability


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=PEERS)
    ap.add_argument("--as-cuda", metavar="MAJOR.MINOR", help="answer CUDA of this capability (e.g. 9.0)")
    args = ap.parse_args(argv)
    if args.as_cuda:
        major, _, minor = args.as_cuda.partition(".")
        force_cuda((int(major), int(minor or 0)))
    print(json.dumps(import_all(args.peer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
