"""Torch-free tokenizer wrapper over transformers' fast tokenizer read from a local HF folder.

The router and the engine both use it; `hf` exposes the underlying tokenizer for incremental detokenization.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, folder: str | os.PathLike[str]) -> None:
        path = Path(folder)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder {path} does not exist")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Not AutoTokenizer: importing it pulls in torch, and the router must stay torch-free.
        from transformers import PreTrainedTokenizerFast

        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer folder {path} has no tokenizer.json (fast tokenizers only)")
        self.path = path
        self.hf: Any = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids(path))
        self.vocab_size: int = len(self.hf)
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.pad_token_id: int | None = self.hf.pad_token_id

    def _eos_ids(self, path: Path) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        for name in ("generation_config.json", "config.json"):
            file = path / name
            if file.is_file():
                value = json.loads(file.read_text()).get("eos_token_id")
                ids.update([value] if isinstance(value, int) else (value or []))
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template (or `chat_template`, a jinja
        template: rendered in transformers' sandboxed environment)."""
        text = self.render_chat(
            messages,
            add_generation_prompt,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        # By default the template already wrote any BOS/special tokens it wants.
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if chat_template is None and not self.hf.chat_template:
            raise ValueError(f"tokenizer in {self.path} has no chat template; use a completion prompt instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message must be a dict with 'role' and 'content', got {m!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        # template_kwargs are variables for the template only: none may set one of transformers' own arguments
        # (tokenize, return_dict, ...), which would change what comes back.
        reserved = set(inspect.signature(self.hf.apply_chat_template).parameters) | {"conversation", "messages"}
        clash = sorted(set(template_kwargs or {}) & reserved)
        if clash:
            raise ValueError(f"chat template kwargs cannot set {', '.join(clash)}")
        kwargs = dict(template_kwargs or {})
        kwargs.update(
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
        )
        return self.hf.apply_chat_template(list(messages), **kwargs)
