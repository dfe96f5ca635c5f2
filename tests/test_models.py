from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve import models

# Everything here loads from local paths; offline mode makes a stray hub lookup fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    runs = {"a": 0, "a_again": 0, "b": 1}
    return {name: models.make_model(root / name, "tiny", seed) for name, seed in runs.items()}


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def test_same_seed_gives_identical_files(built: dict[str, Path]) -> None:
    names = sorted(p.name for p in built["a"].iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(p.name for p in built["a_again"].iterdir())
    for name in names:
        assert (built["a"] / name).read_bytes() == (built["a_again"] / name).read_bytes(), name


def test_other_seed_changes_weights_only(built: dict[str, Path]) -> None:
    a, b = built["a"], built["b"]
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_checkpoint_has_no_varying_metadata(built: dict[str, Path]) -> None:
    header = _safetensors_header(built["a"] / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {t["dtype"] for t in header.values()} == {"F32"}  # the tiny preset is float32
    assert "lm_head.weight" in header  # untied


def test_tokenizer_round_trips(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    text = "def greet(name):\n    return f'héllo, {name} ✓'\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # the BPE merges actually learned something
    specials = (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token)
    assert specials == ("<s>", "</s>", "<pad>", "<unk>")


def test_chat_template_renders(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    bare = tok.apply_chat_template(messages, tokenize=False)
    assert bare == prompt.removesuffix("<|assistant|>\n")


def test_model_loads_and_runs(built: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    model = AutoModelForCausalLM.from_pretrained(built["a"])
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert cfg.tie_word_embeddings is False
    assert cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (128, 2, 2)
    ids = tok("import os", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_replaces_own_model_not_foreign_dir(built: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "m"
    shutil.copytree(built["b"], target)
    models.make_model(target, "tiny", 0)
    weights = (target / "model.safetensors").read_bytes()
    assert weights == (built["a"] / "model.safetensors").read_bytes()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        models.make_model(foreign, "tiny", 0)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]  # no temp dirs left


def test_ensure_model_builds_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    first = models.ensure_model("tiny", 0)
    assert first == tmp_path / "models" / "tiny-seed0" == models.default_model_dir("tiny", 0)
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args: object, **kwargs: object) -> Path:
        raise AssertionError("ensure_model rebuilt a complete model")

    monkeypatch.setattr(models, "make_model", no_rebuild)
    assert models.ensure_model("tiny", 0) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_model_concurrent_callers_build_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    builds: list[Path] = []
    real_make_model = models.make_model

    def counting(out_dir: Path, preset: str, seed: int) -> Path:
        builds.append(out_dir)
        return real_make_model(out_dir, preset, seed)

    monkeypatch.setattr(models, "make_model", counting)
    # flock locks belong to open file descriptions, so two threads contend like two processes.
    start = threading.Barrier(2)
    results: list[Path] = []

    def call() -> None:
        start.wait()
        results.append(models.ensure_model("tiny", 1))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [models.default_model_dir("tiny", 1)] * 2


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDSERVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home/.cache/pdserve/models/bench-seed3"
    assert models.default_model_dir("bench", 3) == expected
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg/pdserve"
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny"):
        models.make_model(tmp_path / "x", "huge")
    assert list(tmp_path.iterdir()) == []


def test_import_is_cheap() -> None:
    heavy = "{'torch', 'transformers', 'tokenizers'}"
    code = f"import sys, pdserve.models; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
