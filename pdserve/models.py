"""Random-weight Llama checkpoints, built offline, for tests and benchmarks.

No weights can be downloaded here, so `make_model` trains a small byte-level BPE tokenizer on
Python's own standard-library sources and saves a randomly initialised Llama beside it. The same
preset and seed give byte-identical files on the same Python (the training text is its stdlib).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 2048  # BPE training target; the config gets the tokenizer's real size
    max_position_embeddings: int = 4096
    # float32: vLLM's CPU bf16 kernels died with SIGILL (AMX paths) on the VMs here.
    dtype: str = "float32"


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(128, 256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # Big enough that prefilling ~2,000 tokens costs many decode steps on CPU.
    "bench": ModelShape(
        256, 1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ),
}

# ~2 MB of text reaches the 2,048-token vocabulary and trains in about a second.
CORPUS_BYTES = 2_000_000

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Written last into a finished model: names what was built, so a changed preset rebuilds the cache.
MARKER = "pdserve-model.json"


def make_model(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    *,
    corpus_bytes: int | None = None,
) -> Path:
    """Build tokenizer + random weights into `out_dir`, which appears complete or not at all.

    An existing pdserve model (or empty directory) at `out_dir` is replaced; anything else there
    raises FileExistsError.
    """
    shape = _shape(preset)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model should not be
        tokenizer = _train_tokenizer(shape, corpus_bytes or CORPUS_BYTES)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        _random_llama(shape, seed, tokenizer).save_pretrained(tmp)
        (tmp / MARKER).write_text(_marker(preset, seed, corpus_bytes))
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes weights 0600; the model is not secret
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cache_dir() -> Path:
    if env := os.environ.get("PDSERVE_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"


def default_model_dir(preset: str = "tiny", seed: int = 0) -> Path:
    _shape(preset)
    return cache_dir() / "models" / f"{preset}-seed{seed}"


def ensure_model(preset: str = "tiny", seed: int = 0) -> Path:
    """Return the cached model for (preset, seed), building it once; safe across processes."""
    out = default_model_dir(preset, seed)
    if _is_complete(out, preset, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_complete(out, preset, seed):  # someone may have built it while we waited
            # Under the lock, leftover temp dirs belong to builders that died.
            for stale in out.parent.glob(f".{out.name}.*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            make_model(out, preset, seed)
    return out


# What `pdserve serve` and `pdserve controller` name the model they build when given none (the
# "model" of a request); a model given with --model keeps vLLM's default, its path.
BUILTIN_MODEL_NAME = "tiny"


def resolve_model(model: str | None, preset: str = "tiny") -> str:
    """`model` when given, else the cached model of `preset` (built the first time)."""
    return model or str(ensure_model(preset))


def _shape(preset: str) -> ModelShape:
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}") from None


def _marker(preset: str, seed: int, corpus_bytes: int | None) -> str:
    info: dict[str, Any] = {"preset": preset, "seed": seed, **asdict(_shape(preset))}
    info["corpus_bytes"] = corpus_bytes or CORPUS_BYTES
    return json.dumps(info, indent=2, sort_keys=True) + "\n"


def _is_complete(out: Path, preset: str, seed: int) -> bool:
    try:
        return (out / MARKER).read_text() == _marker(preset, seed, None)
    except OSError:
        return False


def _move_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    if any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and is not a pdserve model; not replacing it")
    # Swap with two renames so readers see the old model or the new one, never a mix.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rename(out, old / "model")
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _corpus(limit: int) -> Iterator[str]:
    """Top-level stdlib modules in sorted order, cut at about `limit` characters."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    left = limit
    for path in sorted(stdlib.glob("*.py")):
        if left <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")[:left]
        left -= len(text)
        yield text
    if left == limit:
        raise RuntimeError(f"no Python sources under {stdlib} to train a tokenizer on")


def _train_tokenizer(shape: ModelShape, corpus_bytes: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(corpus_bytes), trainer)
    # Llama-style: plain encoding starts with BOS; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=shape.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def _random_llama(
    shape: ModelShape, seed: int, tokenizer: PreTrainedTokenizerFast
) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        # The tokenizer's exact size: a random model must not sample ids it cannot decode.
        vocab_size=len(tokenizer),
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=shape.dtype,
    )
    with torch.random.fork_rng(devices=[]):  # seed locally; leave the caller's RNG alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.to(getattr(torch, shape.dtype))
