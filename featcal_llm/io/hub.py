"""`--push-to-hub`: the calibrated model uploaded to a Hugging Face Hub repository, after a successful run only."""

from __future__ import annotations

from pathlib import Path

from featcal_llm.errors import FeatCalError, RunFailure


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed repository id before any work (huggingface_hub's own rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise FeatCalError(f"--push-to-hub {repo_id}: not a Hub repository id ({str(error).splitlines()[0]})") from None


def push_folder(folder: Path, repo_id: str, private: bool = True) -> str:
    """Create the model repository if needed (private unless told otherwise) and upload the folder; returns its URL."""
    from huggingface_hub import HfApi

    from featcal_llm import runlog

    from featcal_llm.io.card import point_usage_at

    point_usage_at(folder, repo_id)  # the card's usage snippet loads the repository it is published in
    api = HfApi()
    runlog.stage(f"uploading {folder} to the Hub as {repo_id} ({'private' if private else 'public'})")
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message="featcal-llm: calibrated model")
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RunFailure(f"--push-to-hub {repo_id}: upload failed ({first}); the calibrated model is kept in {folder}") from error
    runlog.stage(f"uploaded to {url}")
    return str(url)
