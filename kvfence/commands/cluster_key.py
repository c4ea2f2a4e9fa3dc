"""`kvfence cluster-key PATH`: write a new deployment secret for roles started on several hosts.

What it knows: how to draw a fresh cluster key and write it to a new file only its owner can read
(`kvfence.auth.keys`), and what to tell the operator: copy the same file to every host of the
deployment and start each role with `--cluster-key-file PATH`. It prints the key's id (safe to
show), never the key. What it does not know: how the planes use the key.
"""

from __future__ import annotations

import argparse
import sys

from kvfence.auth.keys import ClusterKey, ClusterKeyError, write_key_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster-key",
        help="write a new cluster key (the secret that authenticates a deployment's workers) to a file",
        description="Write a new 32-byte cluster key, as hex, to PATH (created with mode 600; an existing file is "
        "never overwritten). Give the same file to every router and worker of one deployment with "
        "--cluster-key-file PATH (or $KVFENCE_CLUSTER_KEY_FILE).",
    )
    p.add_argument("path", metavar="PATH", help="the file to create")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    key = ClusterKey.generate()
    try:
        write_key_file(args.path, key)
    except FileExistsError:
        raise ClusterKeyError(f"{args.path} exists; a cluster key file is never overwritten") from None
    except OSError as e:
        raise ClusterKeyError(f"cannot create {args.path}: {e.strerror or e}") from None
    print(f"wrote cluster key {key.key_id} to {args.path} (mode 600); start every role with --cluster-key-file "
          f"{args.path}", file=sys.stderr)  # fmt: skip
    return 0
