"""One-time GGUF → Hugging Face folder conversion (dequantized fp32 safetensors + tokenizer + configs).

transformers reads GGUF metadata, dequantizes every tensor and undoes llama.cpp's Q/K row permutation; we
only map names onto a weightless (meta-device) model and write the result. The folder is built in a temporary
sibling directory and renamed into place, so concurrent processes converting the same file are safe: the
first rename wins and the others discard their copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# Written into every converted folder: where it came from (its weights are a GGUF's, dequantized to fp32).
SOURCE_FILE = "ucm_source.json"

# How many conversions this process ran (tests assert a cached second load does not convert again).
conversions_done = 0


def _offline() -> None:
    # Set before transformers is imported anywhere in this process: nothing is ever fetched from a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _write_folder(gguf_path: Path, out: Path) -> None:
    _offline()
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    with tqdm(total=4, desc=f"converting {name}", unit="step") as bar:
        log.info("converting %s: reading its config", name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        config.dtype = torch.float32
        bar.update(1)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        log.info("converting %s: dequantizing its tensors", name)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
        expected = set(skeleton.state_dict())
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
            expected.discard("lm_head.weight")
        missing = expected - set(tensors)
        assert not missing, f"GGUF {gguf_path} lacks tensors {sorted(missing)[:5]}"
        tensors = {k: v.to(torch.float32).contiguous() for k, v in tensors.items() if k in expected}
        bar.update(1)
        log.info("converting %s: writing %d fp32 tensors", name, len(tensors))
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        GenerationConfig.from_model_config(config).save_pretrained(out)
        bar.update(1)
        log.info("converting %s: building the tokenizer", name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(out)
        _embed_chat_template(out, tokenizer.chat_template)
        bar.update(1)
    (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path), "converted_at": time.time()}))


def _embed_chat_template(out: Path, template: str | None) -> None:
    """Also keep the chat template inside tokenizer_config.json, where older readers look for it."""
    if not template:
        return
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


@contextlib.contextmanager
def _still_working(what: str, every_s: float = 10.0) -> Iterator[None]:
    """A log line every `every_s` while a step runs: a conversion takes about a minute on a small CPU, and when
    its output is not a terminal (a launcher's log) the progress bars show nothing until a step ends."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            log.info("%s: %.0f s so far", what, time.monotonic() - start)

    thread = threading.Thread(target=tick, name="ucm-convert-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _remove_stale_tmp_dirs(parent: Path, max_age_s: float = 6 * 3600) -> None:
    """Leftovers of conversions that crashed; anything this old cannot still be in progress."""
    now = time.time()
    for tmp in parent.glob(".*.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantize `gguf_path` into the HF folder `target` (atomically); returns `target`."""
    global conversions_done
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target.parent)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _still_working(f"converting {gguf_path.name}"):
            _write_folder(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is non-empty): keep theirs.
            if not (target / "config.json").is_file():
                raise
            log.info("another process already converted %s; using its folder", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    conversions_done += 1
    log.info("converted %s -> %s in %.1f s", gguf_path, target, time.perf_counter() - start)
    return target


if __name__ == "__main__":  # `python -m engine.gguf_convert FILE.gguf TARGET_DIR` (model_source's child process)
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 3:
        sys.exit("usage: python -m engine.gguf_convert FILE.gguf TARGET_DIR")
    convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
