#!/usr/bin/env python3
"""Check a patched llama.cpp tree against the patch queue's manifest.json.

Usage: verify_manifest.py TREE PATCH_DIR

PATCH_DIR holds `series`, the patches and `manifest.json` (written by
`rollkv patches export`): the sha256 of every patch and of every file the
series touches, as they are after applying the whole series to the pinned
tree. Used by recipe/build.sh (conda) and by flake.nix (postPatch), so both
builds are "byte-identical-verified" like `rollkv source`. Standard library
only: it runs in a conda build environment or the Nix sandbox.
"""

import hashlib, json, os, sys

tree, patch_dir = sys.argv[1], sys.argv[2]
names = []
with open(os.path.join(patch_dir, "series")) as f:
    for line in f:
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
path = os.path.join(patch_dir, "manifest.json")
if not os.path.exists(path):
    if names:
        sys.exit(f"verify_manifest: {len(names)} patches but no manifest.json in the patch queue")
    print("verify_manifest: empty series, nothing to verify")
    sys.exit(0)
with open(path) as f:
    manifest = json.load(f)

def sha256(p):
    with open(p, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()

listed = [p["name"] for p in manifest["series"]]
if listed != names:
    sys.exit(f"verify_manifest: series {names} differs from the manifest {listed}")
for p in manifest["series"]:
    got = sha256(os.path.join(patch_dir, p["name"]))
    if got != p["sha256"]:
        sys.exit(f"verify_manifest: {p['name']} has sha256 {got}, the manifest says {p['sha256']}")
bad = []
for rel, want in sorted(manifest["files"].items()):
    full = os.path.join(tree, rel)
    if os.path.islink(full):
        got = "symlink:" + os.readlink(full)
    elif os.path.isfile(full):
        got = sha256(full)
    else:
        got = None
    if got != want:
        bad.append(f"{rel} (expected {want}, found {got})")
if bad:
    sys.exit("verify_manifest: patched tree differs from the manifest: " + "; ".join(bad))
print(f"verify_manifest: byte-identical-verified ({len(manifest['files'])} files)")
