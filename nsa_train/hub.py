"""Hugging Face Hub: check the token and the repository before training, upload the exported checkpoint after.

Endpoints used (all through `huggingface_hub.HfApi`, so `HF_ENDPOINT` redirects them): `whoami-v2`,
`repos/create`, and `upload_folder` (`preupload` + `commit`; `create_branch` for branch pushes).
"""

from __future__ import annotations

from pathlib import Path

from .data import check_hub_reachable


class HubError(RuntimeError):
    pass


def preflight(repo_id: str, token: str | None = None, private: bool = False):
    """Fail in seconds, before any training step: no token, Hub unreachable, bad token, repo not writable."""
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise HubError(
            f"--push-to-hub {repo_id}: no Hugging Face token. Run `hf auth login` or set HF_TOKEN "
            "(a token with write access), or drop --push-to-hub."
        )
    try:
        check_hub_reachable(f"--push-to-hub {repo_id}", hint="Check the network, or drop --push-to-hub.")
    except ConnectionError as e:
        raise HubError(str(e)) from e
    api = HfApi(token=token)
    try:
        user = api.whoami()
    except Exception as e:  # noqa: BLE001 - HTTP errors, invalid token
        raise HubError(f"--push-to-hub {repo_id}: the token was rejected by {api.endpoint} ({e}).") from e
    try:
        url = api.create_repo(repo_id, exist_ok=True, private=private)
    except Exception as e:  # noqa: BLE001
        raise HubError(
            f"--push-to-hub {repo_id}: cannot create or access the repository as {user.get('name')!r} ({e})."
        ) from e
    return api, str(url)


def preflight_on_main(accelerator, repo_id: str | None, private: bool = False):
    """`preflight` on the main process, its HubError raised on every process (all stop before training). Returns
    the API client on the main process; None elsewhere, or when `repo_id` is None (the run does not push)."""
    if not repo_id:
        return None
    from accelerate.utils import broadcast_object_list

    api, error = None, [None]
    if accelerator.is_main_process:
        try:
            api, url = preflight(repo_id, private=private)
            accelerator.print(f"hub: pushing to {url}")
        except HubError as e:
            error = [str(e)]
    if accelerator.num_processes > 1:
        broadcast_object_list(error)
    if error[0]:
        raise HubError(error[0])
    return api


def push_folder(api, repo_id: str, folder: Path, message: str, branch: str | None = None):
    """Upload `folder` as one commit on `branch` (default: main; a branch is created from main if missing)."""
    if branch:
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message, revision=branch)
