"""Lazy access to the tensors of one or more safetensors files.

Headers (names, shapes, dtypes) are read up front so a reader can validate a whole checkpoint or
adapter before it reads a single tensor; tensor data is read only on :meth:`TensorSource.get`.
A sharded checkpoint is read through its ``*.safetensors.index.json`` (``weight_map``: key → shard
file, as transformers writes it); without an index every ``*.safetensors`` file of the directory is
read and a key found twice is an error. Pickled weights (``pytorch_model.bin``,
``adapter_model.bin``) are never read: unpickling can run code; the error names them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

#: safetensors dtype codes → torch dtypes (the floating ones moelora reads, plus ints for errors).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}


#: Pickled weight files (``torch.save``) that moelora never opens, named in the "no safetensors" error.
_PICKLED: tuple[str, ...] = ("*.bin", "*.pt", "*.pth", "*.ckpt")


class TensorSource:
    """Tensors of a set of safetensors files, by key, read lazily.

    Args:
        files: the files to read.
        weight_map: key → file, when an index names the shard of each key (otherwise built from
            the headers).
        error: builds the exception raised for a malformed source: ``error(subject, problem)``.

    Raises (on construction):
        whatever ``error`` builds: an unreadable file, a key stored in two files, an index naming a
        key its shard does not hold.
    """

    def __init__(
        self,
        files: list[Path],
        *,
        weight_map: dict[str, str] | None = None,
        error: Callable[[str, str], Exception],
    ) -> None:
        self._error = error
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        for file in files:
            handle = self._open(file)
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key) != file.name:
                    continue  # the index assigns this key to another shard (or to none): not read
                if key in self._where:
                    raise error(key, f"stored twice, in {self._where[key].name} and {file.name}")
                sl = handle.get_slice(key)
                self._where[key] = file
                self._shape[key] = tuple(int(d) for d in sl.get_shape())
                self._dtype[key] = str(sl.get_dtype())
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self._where)
            if missing:
                raise error(missing[0], f"listed in the shard index but absent from {weight_map[missing[0]]}")

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError / OSError
                raise self._error(file.name, f"unreadable safetensors file: {exc}") from None
        return self._handles[file]

    @classmethod
    def from_directory(
        cls, directory: Path, *, stem: str, error: Callable[[str, str], Exception]
    ) -> TensorSource:
        """The tensors of ``directory``: ``{stem}.safetensors``, or its sharded index
        ``{stem}.safetensors.index.json``, or else every ``*.safetensors`` file there.

        Raises:
            whatever ``error`` builds: no safetensors file (naming any pickled ``*.bin`` / ``*.pt``
            files found instead, which are never read), an unreadable index.
        """
        index = directory / f"{stem}.safetensors.index.json"
        single = directory / f"{stem}.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise error(index.name, f"not a valid shard index: {exc!r}") from None
            files = sorted({directory / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise error(f.name, "shard named by the index is missing")
            return cls(files, weight_map=dict(weight_map), error=error)
        if single.is_file():
            return cls([single], error=error)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for pattern in _PICKLED for p in directory.glob(pattern))
            if pickled:
                raise error(", ".join(pickled), f"pickled PyTorch weights are not read (loading a pickle can run "
                            f"arbitrary code); no safetensors file in {directory}: convert them to "
                            f"{stem}.safetensors (e.g. save_pretrained(safe_serialization=True))")
            raise error(f"{stem}.safetensors", f"no safetensors file in {directory}")
        return cls(files, error=error)

    def keys(self) -> list[str]:
        """Every key, sorted."""
        return sorted(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape from the header (no data read)."""
        return self._shape[key]

    def dtype_name(self, key: str) -> str:
        """The stored dtype as torch names it ("float16", ...), from the header."""
        code = self._dtype[key]
        return str(_DTYPES[code]).removeprefix("torch.") if code in _DTYPES else code

    def get(self, key: str) -> torch.Tensor:
        """The tensor, as stored (dtype and layout), on the CPU."""
        return self._open(self._where[key]).get_tensor(key)

    def close(self) -> None:
        """Drop the file handles (safetensors closes the mapping when the handle is collected)."""
        self._handles.clear()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
