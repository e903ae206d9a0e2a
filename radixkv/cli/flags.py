"""The flags more than one command defines, defined once: the KV layout group and its parsing
(`serve`, `calc`), where a service is (`inspect`, `stats`, `events`, `clear`, `chat`), the
eviction policy and the sink share (`serve`, `replay`), the long-running servers' logging and
parent watch (`serve`, `router`, `gateway`), and the argparse types they use."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from kvpool.layout import PRESETS, SINK_TOKENS, KVLayout, parse_bytes
from radixkv.index.policies import DEFAULT_POLICY, POLICIES
from radixkv.protocol.errors import InvalidArgument

QUANTIZED_KV_DTYPES = ("int8", "int4")  # what --kv-dtype stores
SINK_FRACTION = 0.125  # the share of sink blocks (a sequence's first block) by default


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_connection_flags(p: argparse.ArgumentParser, socket_help: str,
                         default: Any = None) -> None:
    """--socket PATH or --target TARGET, one of them (`default`: both flags' default)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", default=default, help=socket_help)
    where.add_argument("--target", metavar="TARGET", default=default,
                       help="a gRPC target instead, e.g. unix:///path or 127.0.0.1:50051")


def connection_parent(suppress: bool) -> argparse.ArgumentParser:
    """A parent parser of --socket / --target and --json. `suppress`: for sub-views, which
    repeat these flags with SUPPRESS defaults so that `inspect --json tree X` and
    `inspect tree X --json` both work (a subparser's defaults would overwrite)."""
    d = argparse.SUPPRESS if suppress else None
    c = argparse.ArgumentParser(add_help=False)
    add_connection_flags(c, "the service's Unix socket (default: as the client resolves it)", d)
    c.add_argument("--json", action="store_true", default=d or False,
                   help="machine-readable output")
    return c


def service_target(args: argparse.Namespace) -> str | None:
    """The service the read-only views connect to: --target, else --socket as an absolute
    path, else None (the client resolves it)."""
    return args.target or (os.path.abspath(args.socket) if args.socket else None)


def add_policy_flag(g: Any, of: str = "") -> None:
    """--policy: the eviction policy (`of`: whose, in the help)."""
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES,
                   help=f"eviction policy{of} (default {DEFAULT_POLICY})")


def add_sink_fraction_flag(g: Any, help: str, metavar: str | None = None) -> None:
    """--kv-sink-fraction: the share of sink blocks of a quantized pool with sink tokens."""
    g.add_argument("--kv-sink-fraction", type=float, default=SINK_FRACTION, metavar=metavar,
                   help=help)


def add_layout_flags(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    g = p.add_argument_group("KV layout (one model)")
    g.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                   help=f"built-in model geometry (default: {default_preset})")
    g.add_argument("--model-config", metavar="PATH",
                   help="a Hugging Face config.json (or its folder) instead of --preset")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "fp8", "int8", "int4"],
                   help="the model's KV element type (default: the model's, usually bf16); "
                        "int8/int4 here mean --kv-dtype with a bf16 model")
    g.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per block (default: 16)")
    g.add_argument("--kv-dtype", choices=QUANTIZED_KV_DTYPES,
                   help="store KV quantized: int8 (symmetric, a scale per token and head) or "
                        "int4 (asymmetric, keys per channel, values per token group); engines "
                        "read it back in --dtype")
    g.add_argument("--kv-sink-tokens", type=int, default=SINK_TOKENS, metavar="N",
                   help=f"with --kv-dtype: the first N tokens of every sequence stay in --dtype "
                        f"(attention sinks; default {SINK_TOKENS}, 0 for none)")
    g.add_argument("--kv-group-size", type=int, default=0, metavar="G",
                   help="with --kv-dtype: elements per scale along head_dim (default 0: one "
                        "scale per head)")
    g.add_argument("--kv-key-scales", choices=["channel", "token"], default="channel",
                   help="with --kv-dtype int4: keys scaled per channel over a block's tokens "
                        "(default) or per token group like values")
    g.add_argument("--sliding-window", type=positive_int, metavar="W",
                   help="sliding-window attention of W tokens (a query sees itself and the W-1 "
                        "before it) on the --window-layers; overrides the preset's or config's")
    g.add_argument("--window-layers", metavar="SPEC",
                   help="the layers the window applies to (default: the model's own, else all): "
                        "all (Mistral-7B-v0.1), "
                        "alternate (even layers windowed, odd full: Gemma-2, gpt-oss), N:M (N "
                        "windowed then M full, repeating: Gemma-3 is 5:1) or indices like "
                        "0-3,8")


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    if args.model_config:
        layout = KVLayout.from_hf_config(args.model_config, args.dtype, args.block_size)
    elif not args.preset:
        raise SystemExit("give --preset NAME or --model-config PATH")
    else:
        layout = KVLayout.from_preset(args.preset, args.dtype, args.block_size)
    layout = window_from_args(layout, args)
    if args.kv_dtype:
        if layout.is_quantized:
            raise SystemExit(f"--kv-dtype {args.kv_dtype} with --dtype {layout.dtype}: give the "
                             "model's dtype as --dtype")
        layout = replace(layout.with_dtype(args.kv_dtype, args.kv_sink_tokens),
                         group_size=args.kv_group_size, key_scales=args.kv_key_scales)
    return layout


def window_from_args(layout: KVLayout, args: argparse.Namespace) -> KVLayout:
    """--sliding-window and --window-layers over the preset's or config's own window."""
    window, spec = args.sliding_window, args.window_layers
    if spec is not None and window is None and not layout.is_windowed:
        raise InvalidArgument(f"--window-layers {spec} needs --sliding-window W: this model "
                              "has no sliding window")
    if window is None and spec is None:
        return layout
    return layout.with_window(window or layout.sliding_window,
                              spec if spec is not None else layout.window_pattern or "all")


def window_fraction_from_args(layout: KVLayout, text: str | None) -> float | None:
    """--window-fraction checked against the layout (None when not given)."""
    if text is None:
        return None
    from kvpool.sizing import check_window_fraction

    if not layout.is_windowed:
        raise InvalidArgument(f"--window-fraction {text} needs a sliding-window layout (a "
                              "windowed preset, a model config with sliding_window, or "
                              "--sliding-window W); this one has full attention on every layer")
    try:
        return check_window_fraction(layout, float(text))
    except (InvalidArgument, ValueError) as e:
        raise InvalidArgument(f"--window-fraction {text}: {e}") from None


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """--log-level and --exit-with-parent, for the commands that serve until stopped."""
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits (Linux)")


def start_logging(args: argparse.Namespace) -> None:
    """The root logger at --log-level, one line per record with its time and logger."""
    import logging

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def add_etcd_flags(g: Any) -> None:
    """TLS and auth toward etcd (radixkv/rpc/etcd.py EtcdSecurity)."""
    g.add_argument("--etcd-ca", metavar="PEM",
                   help="talk TLS to etcd, trusting this CA (default $RADIXKV_ETCD_CA; off)")
    g.add_argument("--etcd-cert", metavar="PEM",
                   help="client certificate for an etcd with --client-cert-auth (with "
                   "--etcd-key)")
    g.add_argument("--etcd-key", metavar="PEM", help="the client certificate's private key")
    g.add_argument("--etcd-user", metavar="NAME",
                   help="etcd auth user (default $RADIXKV_ETCD_USER); grant it readwrite on "
                   "/radixkv/ only")
    g.add_argument("--etcd-password-file", metavar="PATH",
                   help="the etcd user's password: the file's first line (default "
                   "$RADIXKV_ETCD_PASSWORD)")


def etcd_security_from_args(args: argparse.Namespace) -> Any:
    """The EtcdSecurity the etcd flags (and their RADIXKV_ETCD_* defaults) describe."""
    from radixkv.protocol.env import etcd_settings
    from radixkv.rpc.etcd import EtcdSecurity

    env = etcd_settings()
    password = env.get("password")
    if args.etcd_password_file:
        try:
            with open(args.etcd_password_file) as f:
                password = (f.readline() or "").strip()
        except OSError as e:
            raise SystemExit(f"--etcd-password-file: {e}") from None
    return EtcdSecurity(ca=args.etcd_ca or env.get("ca"), cert=args.etcd_cert,
                        key=args.etcd_key, user=args.etcd_user or env.get("user"),
                        password=password)


def add_disk_flags(p: argparse.ArgumentParser) -> None:
    """`radixkv serve`'s disk tier flags (radixkv/disk/)."""
    g = p.add_argument_group("disk tier (docs/disk-tier.md)")
    g.add_argument("--disk-dir", metavar="DIR",
                   help="a tier below the pool in DIR (an existing directory of this user on a "
                   "local filesystem): blocks the pool evicts are written there and stay "
                   "hittable (a Match promotes them back); a clean stop writes the pool's "
                   "cached blocks down, and a start on the same DIR serves them again")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--disk-capacity", metavar="SIZE",
                   help="the tier's file size, e.g. 100GiB (preallocated at start)")
    d.add_argument("--disk-capacity-blocks", type=positive_int, metavar="N",
                   help="the tier's size in blocks (instead of --disk-capacity)")
    g.add_argument("--disk-promote-blocks", type=positive_int, default=1 << 20, metavar="N",
                   help="the most blocks one Match query brings up from disk (default: all "
                   "that continue its cached prefix)")


def disk_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's disk tier fields from the serve flags (InvalidArgument: exit 2)."""
    if not args.disk_dir:
        if args.disk_capacity or args.disk_capacity_blocks:
            raise InvalidArgument("--disk-capacity needs --disk-dir")
        return {}
    if not (args.disk_capacity or args.disk_capacity_blocks):
        raise InvalidArgument("--disk-dir needs --disk-capacity SIZE or --disk-capacity-blocks N")
    try:
        size = parse_bytes(args.disk_capacity) if args.disk_capacity else None
    except Exception as e:  # kvpool's InvalidArgument: the unreadable size
        raise InvalidArgument(f"--disk-capacity: {e}") from None
    return {"disk_dir": args.disk_dir, "disk_capacity_blocks": args.disk_capacity_blocks,
            "disk_capacity_bytes": size, "disk_promote_blocks": args.disk_promote_blocks}
