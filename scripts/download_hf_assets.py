"""Fetch the tokenizer files of a Hugging Face model repo into ``assets/``, where the large configs look for them.

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer \\
        --local_dir assets/tokenizer/llama3

Why: ``train_configs/llama3_*.toml`` read ``./assets/tokenizer/llama3/tokenizer.json`` (and its
``tokenizer_config.json``, which names BOS/EOS), and the repository does not ship Meta's files: they sit behind
the license of a gated repo. The Meta repos are gated: accept the license on the model's page, then pass a token
with ``--hf_token`` or ``HF_TOKEN`` (or log in once with ``hf auth login``).

``--repo_id`` may also be a local folder (a checkout of the repo, or files copied from a machine with network):
the same files are copied from it. Failures (gated repo without a token, no such repo or folder, no network)
exit 2 with one line that names the problem and the fix.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

# What titan_dmuon's HFTokenizer reads (tokenizer.json plus the config naming BOS/EOS), and tokenizer.model for
# tools that want the SentencePiece/tiktoken file. Only the repo's top level is looked at.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
ASSETS = {"tokenizer": TOKENIZER_FILES}
REQUIRED = "tokenizer.json"


class AssetError(Exception):
    """A failure the user can fix; its message is the one line printed."""


def _is_local(repo_id: str) -> bool:
    """A folder here, or something that is spelled like a path rather than a Hub id (``owner/name``)."""
    return os.path.isdir(repo_id) or repo_id.startswith(("/", "./", "../", "~")) or repo_id.count("/") > 1


def _copy_local(folder: str, wanted: tuple[str, ...], local_dir: str) -> list[str]:
    folder = os.path.expanduser(folder)
    if not os.path.isdir(folder):
        raise AssetError(f"{folder}: no such folder; give an existing local folder or a Hub repo id (owner/name)")
    present = [name for name in wanted if os.path.isfile(os.path.join(folder, name))]
    _check_required(folder, present)
    os.makedirs(local_dir, exist_ok=True)
    out = []
    for name in present:
        out.append(shutil.copyfile(os.path.join(folder, name), os.path.join(local_dir, name)))
    return out


def _check_required(source: str, present: list[str]) -> None:
    if REQUIRED not in present:
        raise AssetError(
            f"{source} has no {REQUIRED} (titan_dmuon reads the Hugging Face tokenizer.json); pick the repo of a "
            "model that ships one, or train one with scripts/train_tokenizer.py"
        )


def _is_network_error(e: BaseException) -> bool:
    """No connection, DNS failure, timeout or offline mode, whichever HTTP library huggingface_hub uses."""
    names = {c.__name__ for c in type(e).__mro__}
    network = {"LocalEntryNotFoundError", "TransportError", "ConnectionError", "Timeout", "TimeoutException"}
    return isinstance(e, (ConnectionError, TimeoutError)) or bool(names & network)


def _download_hub(repo_id: str, wanted: tuple[str, ...], local_dir: str, token: str | None) -> list[str]:
    import huggingface_hub
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    page = f"https://huggingface.co/{repo_id}"
    try:
        present = [name for name in huggingface_hub.list_repo_files(repo_id, token=token) if name in wanted]
        _check_required(repo_id, present)
        return [huggingface_hub.hf_hub_download(repo_id, name, local_dir=local_dir, token=token) for name in present]
    except AssetError:
        raise
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        if token:
            raise AssetError(
                f"{repo_id} is gated and this token has no access yet; accept the license at {page} with the "
                "account of the token (HF_TOKEN / --hf_token), wait for approval, then re-run"
            ) from None
        raise AssetError(
            f"{repo_id} is gated: accept its license at {page}, then set HF_TOKEN (or pass --hf_token) to a token "
            "of that account (https://huggingface.co/settings/tokens) and re-run"
        ) from None
    except RepositoryNotFoundError:
        hint = "" if token else " or private (then set HF_TOKEN or pass --hf_token)"
        raise AssetError(
            f"{repo_id}: no such repo on the Hub{hint}; check the spelling (owner/name, e.g. meta-llama/Llama-3.1-8B)"
        ) from None
    except RevisionNotFoundError:
        raise AssetError(f"{repo_id}: no main branch; check the repo id") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise AssetError(
                f"{repo_id}: the Hub refused the token (HTTP {status}); set HF_TOKEN (or --hf_token) to a valid "
                "token from https://huggingface.co/settings/tokens"
            ) from None
        raise AssetError(f"{repo_id}: the Hub answered {status} ({str(e).splitlines()[0]}); try again later") from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        first = (str(e).splitlines() or [""])[0]
        raise AssetError(
            f"cannot reach the Hugging Face Hub ({type(e).__name__}: {first}); check the network or proxy "
            "(HF_HUB_OFFLINE must be unset), or copy the files from a machine that can and pass that folder "
            "as --repo_id"
        ) from None


def download(repo_id: str, assets: list[str], local_dir: str, token: str | None = None) -> list[str]:
    """Put the files of each asset kind from ``repo_id`` (a Hub repo or a local folder) into ``local_dir``.
    Returns their paths; raises ``AssetError`` with the message to print."""
    wanted = tuple(name for kind in assets for name in ASSETS[kind])
    if _is_local(repo_id):
        return _copy_local(repo_id, wanted, local_dir)
    return _download_hub(repo_id, wanted, local_dir, token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo_id", required=True, help="Hub repo (e.g. meta-llama/Llama-3.1-8B) or a local folder")
    p.add_argument("--assets", nargs="+", default=["tokenizer"], choices=sorted(ASSETS), help="what to fetch")
    p.add_argument("--local_dir", default=None, help="where to put the files (default: assets/tokenizer/<repo name>)")
    p.add_argument("--hf_token", default=None, help="Hub token for gated repos (default: $HF_TOKEN, or hf auth login)")
    a = p.parse_args(argv)
    local_dir = a.local_dir or os.path.join("assets", "tokenizer", os.path.basename(os.path.normpath(a.repo_id)))
    token = a.hf_token or os.environ.get("HF_TOKEN") or None
    try:
        paths = download(a.repo_id, a.assets, local_dir, token)
    except AssetError as e:
        print(f"download_hf_assets: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing local_dir: permissions, disk full
        print(f"download_hf_assets: error: {local_dir}: {e}; pick another --local_dir or free space", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(f"model.tokenizer = {os.path.join(local_dir, REQUIRED)!r} loads them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
