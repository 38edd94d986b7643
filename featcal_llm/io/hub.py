"""`--push-to-hub`: the login checked before the run, the calibrated model uploaded to a Hugging Face Hub repository after a successful run only."""

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


def check_push(repo_id: str) -> None:
    """Before any work: the repository id is well formed and there is a Hugging Face login to upload with.

    No token at all is known without the network (`huggingface_hub.get_token`: HF_TOKEN or `hf auth login`'s file).
    A token the Hub rejects (whoami answers 401) is refused too; without a network the upload at the end will tell.
    """
    check_repo_id(repo_id)
    from huggingface_hub import HfApi, get_token

    if not get_token():
        raise FeatCalError(f"--push-to-hub {repo_id}: not logged in to the Hugging Face Hub (run `hf auth login` or set HF_TOKEN); "
                           "nothing was computed")
    try:
        HfApi().whoami()
    except Exception as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise FeatCalError(f"--push-to-hub {repo_id}: the Hugging Face token was rejected (401: expired or revoked); "
                               "log in again with `hf auth login`") from None


def push_folder(folder: Path, repo_id: str, private: bool = True) -> str:
    """Create the model repository if needed (private unless told otherwise) and upload the folder; returns its URL."""
    from huggingface_hub import HfApi

    from featcal_llm import runlog

    from featcal_llm.io.card_edits import point_usage_at

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
