"""What `validate` asks the Hugging Face hub: whether a model or dataset exists (one API call, no download), a hub
model's config.json (the cache first), and whether an error means the hub is out of reach (a note) or an answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError

NO_NETWORK = {"TransportError", "NetworkError", "ConnectError", "ConnectionError", "Timeout", "TimeoutException", "OfflineModeIsEnabled"}


def no_network(error: BaseException) -> bool:
    """Whether the hub could not be reached at all (httpx's or requests' transport errors, HF_HUB_OFFLINE), as opposed to an answer."""
    return any(kind.__name__ in NO_NETWORK for kind in type(error).__mro__)


def hub_lookup(kind: str, repo: str, revision: str | None, where: str, offline: list[str]) -> None:
    """Whether a hub model or dataset exists at the revision (one API call, no download); unreachable: `repo` joins `offline`."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    info = HfApi().model_info if kind == "model" else HfApi().dataset_info
    try:
        info(repo, revision=revision)
    except GatedRepoError:
        raise FeatCalError(f"{where}: {repo}: a gated {kind}: accept its licence on the hub and log in (hf auth login)") from None
    except RevisionNotFoundError:
        raise FeatCalError(f"{where}: {repo}: no revision {revision} on the hub") from None
    except RepositoryNotFoundError:
        raise FeatCalError(f"{where}: {repo}: no such {kind} on the hub (or it is private: log in with hf auth login)") from None
    except Exception as error:
        if no_network(error):
            offline.append(repo if kind == "model" else f"{repo} ({kind})")
            return
        raise FeatCalError(f"{where}: {repo}: the hub did not answer ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None


def hub_config(model_path: Any, online: bool) -> dict | None:
    """config.json of a hub model: from the local cache, else (online) downloaded; None when unknown."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(model_path.path, "config.json", revision=model_path.revision)
        if not isinstance(cached, str) and online:
            cached = hf_hub_download(model_path.path, "config.json", revision=model_path.revision)
        return json.loads(Path(cached).read_text(encoding="utf-8")) if isinstance(cached, str) else None
    except Exception:
        return None


__all__ = ["NO_NETWORK", "hub_config", "hub_lookup", "no_network"]
