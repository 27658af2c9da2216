"""The checkpoint's tokenizer for ``"prompt": "text"`` requests: its ``tokenizer.json`` through the
``tokenizers`` library (what transformers' fast tokenizers load), encoded with the tokenizer's own
special tokens (its post-processor adds a BOS where the model's tokenizer does).
"""

from __future__ import annotations

from pathlib import Path

from moelora_runner.errors import InvalidRequestError

TOKENIZER_FILE = "tokenizer.json"


class CheckpointTokenizer:
    """``model_dir/tokenizer.json``, loaded on first use.

    Args:
        model_dir: the checkpoint directory.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir) / TOKENIZER_FILE
        self._tokenizer = None

    @property
    def available(self) -> bool:
        return self.path.is_file()

    def encode(self, text: str, *, request_id: str | None = None) -> list[int]:
        """Token ids of ``text`` (special tokens as the tokenizer adds them).

        Raises:
            InvalidRequestError: the checkpoint has no ``tokenizer.json``.
        """
        if self._tokenizer is None:
            if not self.available:
                raise InvalidRequestError(f"request {request_id!r} prompt" if request_id else "prompt",
                                          f"the checkpoint has no {TOKENIZER_FILE} ({self.path}); "
                                          "give prompt_token_ids instead")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.path))
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)
