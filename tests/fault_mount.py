"""Run one command with a small tmpfs mounted for it, the tmpfs optionally turned read-only while
the command runs; meant to run inside a private mount namespace (`namespace_prefix()`: a user
namespace too, so that it needs no root), where the tmpfs is seen by this process and its
children only.

    python tests/fault_mount.py SPEC_JSON      ->   one JSON line on stdout

SPEC: {"mount": dir, "size": "12m", "argv": [...], "log": file for the command's stderr,
       "readonly_when": path under the mount (turn the mount read-only once it exists) or null,
       "copy": [path under the mount, where to copy it before the mount goes], "timeout": s}
Result: {"rc": exit status, "hung": whether it ran past the timeout (then killed),
         "readonly": whether the mount was turned read-only while the command ran}.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time


def namespace_prefix() -> list[str]:
    """`unshare` arguments for a private mount namespace: in a user namespace (no root needed);
    plain when that is refused and this is root. Raises when neither works."""
    for prefix in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        if prefix[1] == "--mount" and os.geteuid() != 0:
            continue
        try:
            r = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=30)
        except FileNotFoundError as e:
            raise RuntimeError(f"cannot set up the fault: {e}") from None
        if r.returncode == 0:
            return prefix
    raise RuntimeError(f"cannot set up the fault: no mount namespace ({r.stderr.strip()})")


def main(spec: dict) -> dict:
    mnt = spec["mount"]
    os.makedirs(mnt, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size']}", "tmpfs", mnt],
                   check=True)
    try:
        with open(spec["log"], "w") as log:
            proc = subprocess.Popen(spec["argv"], stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + spec["timeout"]
        readonly = False
        when = spec.get("readonly_when")
        if when:
            while not os.path.exists(when) and proc.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.005)                       # a poll for the file, not a delay
            if proc.poll() is None and os.path.exists(when):
                # the mount point read-only (a bind remount: allowed in a user namespace)
                subprocess.run(["mount", "-o", "remount,bind,ro", mnt], check=True)
                readonly = True
        try:
            rc, hung = proc.wait(timeout=max(1.0, deadline - time.monotonic())), False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, hung = proc.wait(), True
        for src, dst in spec.get("copy", []):
            if os.path.exists(src):
                shutil.copytree(src, dst)
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
    return {"rc": rc, "hung": hung, "readonly": readonly}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
