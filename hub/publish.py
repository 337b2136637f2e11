"""Validate the published actors shipped in timm_dora/hub/actors/ and (with --upload) publish them to the Hub.

    python hub/publish.py                    # dry run: validate, print what would be uploaded
    python hub/publish.py --upload           # create repos if needed, upload folders with weights
    python hub/publish.py --only NAME ...    # restrict to some registered actors

Every registered folder is validated (config.json fields, model card metadata header, no stray
or pickle files; with model.safetensors present, a full timm_dora.hub.load_pretrained). Folders
without weights are validated but not uploaded. Exit status 1 on any validation failure.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

try:
    import timm_dora.hub as hub
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import timm_dora.hub as hub

from huggingface_hub import HfApi
from huggingface_hub.repocard import metadata_load

ALLOWED_FILES = {"README.md", hub.CONFIG_NAME, hub.WEIGHTS_NAME}
CARD_TAGS = {"timm", "image-classification", "token-pruning", "dora"}


def check_card(path: Path, name: str) -> List[str]:
    """Problems with a model card's metadata header."""
    if not path.is_file():
        return ["README.md (model card) is missing"]
    try:
        meta = metadata_load(path)
    except Exception as e:  # malformed YAML
        return [f"README.md metadata header does not parse: {e}"]
    if not meta:
        return ["README.md has no metadata header (--- YAML ---)"]
    want = {
        "library_name": "timm-dora",
        "license": "apache-2.0",
        "base_model": f"timm/{name}",
    }
    errors = [f"card {k} is {meta.get(k)!r}, expected {v!r}" for k, v in want.items() if meta.get(k) != v]
    missing = CARD_TAGS - set(meta.get("tags") or [])
    if missing:
        errors.append(f"card tags lack {sorted(missing)}")
    if "imagenet-1k" not in (meta.get("datasets") or []):
        errors.append("card datasets lack 'imagenet-1k'")
    return errors


def check_folder(folder: Path, name: str) -> List[str]:
    """Problems with one actor folder (empty list: valid)."""
    if not folder.is_dir():
        return [f"folder {folder} is missing"]
    errors = [f"unexpected file {p.name} (allowed: {sorted(ALLOWED_FILES)})" for p in sorted(folder.iterdir()) if p.name not in ALLOWED_FILES]
    try:
        config = json.loads((folder / hub.CONFIG_NAME).read_text())
        hub.validate_config(config)
        backbone = config.get("backbone") or {}
        got = f"{backbone.get('architecture')}.{backbone.get('pretrained_tag')}"
        if got != name:
            errors.append(f"config backbone is {got!r} but the folder is registered as {name!r}")
        if (folder / hub.WEIGHTS_NAME).is_file():
            hub.load_pretrained(folder)
    except (OSError, ValueError) as e:
        errors.append(str(e))
    return errors + check_card(folder / "README.md", name)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upload", action="store_true", help="upload to the Hub (default: dry run)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="registered actor names to handle")
    parser.add_argument("--token", default=None, help="Hub token (default: huggingface_hub's login)")
    parser.add_argument("--root", type=Path, default=hub.ACTORS_DIR, help="folder holding the actor folders")
    parser.add_argument("--registry", type=Path, default=None,
                        help="registry file (default: ROOT/registry.json if present, else timm_dora/hub/registry.json)")
    args = parser.parse_args(argv)

    reg_file = args.registry or (args.root / "registry.json" if (args.root / "registry.json").is_file() else hub.REGISTRY_FILE)
    entries = hub.registry(reg_file)
    if not entries:
        print(f"no actors registered in {reg_file}")
        return 1
    names = args.only or sorted(entries)
    failed = False
    unknown = [n for n in names if n not in entries]
    if unknown:
        print(f"not registered: {unknown}; registered: {sorted(entries)}")
        return 1
    registered = {e.get("folder") for e in entries.values()}
    for p in sorted(args.root.iterdir()):
        if p.is_dir() and not p.name.startswith((".", "_")) and p.name not in registered:
            print(f"FAIL {p.name}: folder is not in registry.json")
            failed = True

    uploads = []
    for name in names:
        entry = entries[name]
        if not isinstance(entry, dict) or not isinstance(entry.get("repo_id"), str) or not isinstance(entry.get("folder"), str):
            print(f"FAIL {name}: registry entry needs string 'repo_id' and 'folder', got {entry!r}")
            failed = True
            continue
        folder = args.root / entry["folder"]
        errors = check_folder(folder, name)
        if errors:
            failed = True
            print(f"FAIL {name}:" + "".join(f"\n  - {e}" for e in errors))
        elif (folder / hub.WEIGHTS_NAME).is_file():
            print(f"ok   {name}: {sorted(p.name for p in folder.iterdir())} -> {entry['repo_id']}")
            uploads.append((folder, entry["repo_id"]))
        else:
            print(f"ok   {name}: no {hub.WEIGHTS_NAME} yet (untrained), not uploaded")
    if failed:
        print("validation failed: nothing uploaded")
        return 1
    if not args.upload:
        print(f"dry run: {len(uploads)} folder(s) would be uploaded; pass --upload to publish")
        return 0
    reachable, why = hub.hub_reachable()
    if not reachable:
        print(f"cannot upload: the Hugging Face Hub cannot be reached ({why}); nothing uploaded", file=sys.stderr)
        return 1
    api = HfApi(token=args.token)
    for folder, repo_id in uploads:
        try:
            api.create_repo(repo_id, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, allow_patterns=sorted(ALLOWED_FILES),
                                     commit_message="Publish timm-dora actor")
        except Exception as e:  # network, authentication, permissions: one line, not the HTTP stack
            message = " ".join(str(e).split())[:300] or type(e).__name__
            print(f"upload of {folder.name} to {repo_id} failed: {type(e).__name__}: {message}", file=sys.stderr)
            return 1
        print(f"uploaded {folder.name} -> {getattr(info, 'commit_url', repo_id)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
