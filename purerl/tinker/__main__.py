"""``python3 -m purerl.tinker --model PATH``: serve the Tinker API over a local model on loopback.

Prints one line to export (``TINKER_BASE_URL=… TINKER_API_KEY=…``) on stdout, the model name that
clients pass as ``base_model`` on stderr, and serves until interrupted. ``PATH``: a Hugging Face
folder or a ``.gguf`` file (served from its converted folder; default SmolLM2-135M-Instruct's GGUF).
``--tiny`` first writes a tiny random Llama with a character tokenizer to ``PATH`` (a CPU demo),
a new or empty folder or one ``--tiny`` wrote before. The API key is minted at each start unless
``--api-key`` or ``PURERL_TINKER_API_KEY`` gives one (a restart then keeps its clients' key). A
flag the server cannot honour (a bad limit, a taken port, a device this torch lacks) is refused in
one line before the model loads, exit status 2.
"""

import argparse
import math
import os
import sys
import threading
from pathlib import Path

import attrs

from purerl.tinker.launch import DEFAULT_STORE, device_of, model_folder, service_of, write_tiny_model
from purerl.tinker.limits import Limits, flag
from purerl.tinker.server import KEY_ENV, TinkerServer, checked_key, checked_port

_LIMIT_HELP = {
    "max_samples": "the most num_samples one sample request may ask for",
    "max_tokens": "the most tokens of a sample's prompt, of its max_tokens (None: the room left, capped here) "
                  "and of a forward_backward datum",
    "lora_rank": "the largest LoRA rank served",
    "max_batch_tokens": "the most tokens of one forward_backward call, its datums together",
    "queue_depth": "the most calls queued or running at once (the next is answered 429, which the SDK retries)",
}


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    parser = argparse.ArgumentParser(prog="python3 -m purerl.tinker", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face causal LM folder (with its tokenizer) or "
                        ".gguf file (default: SmolLM2-135M-Instruct's GGUF)")
    parser.add_argument("--name", default=None, help="the base_model name clients pass (default: the model's folder)")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha: adapters scale by alpha / rank")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--store", default=str(DEFAULT_STORE), help="where tinker:// checkpoints are written")
    parser.add_argument("--tiny", action="store_true", help="write a tiny random Llama to --model first (a new or "
                        "empty folder, or one --tiny wrote)")
    parser.add_argument("--api-key", default=None, help=f"the tml- key clients must send (default: ${KEY_ENV}, else "
                        "a new random one each start); a fixed key keeps clients working across restarts")
    for field in attrs.fields(Limits):
        parser.add_argument(flag(field.name), type=int, default=field.default, help=_LIMIT_HELP[field.name])
    return parser


def _checked(args: argparse.Namespace) -> tuple[Limits, str | None]:
    """The limits and the API key the flags give, every flag checked (``ValueError`` in one line)."""
    limits = Limits(**{field.name: getattr(args, field.name) for field in attrs.fields(Limits)})
    if not 0 < args.lora_alpha < math.inf:
        raise ValueError(f"--lora-alpha must be a positive number, got {args.lora_alpha}")
    if args.tiny and args.model is None:
        raise ValueError("--tiny needs --model PATH (the folder to write)")
    if Path(args.store).exists() and not Path(args.store).is_dir():
        raise ValueError(f"--store {args.store}: a file, not a folder for the checkpoints")
    device_of(args.device)
    checked_port(args.port)
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    return limits, None if key is None else checked_key(key)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        limits, key = _checked(args)
        if args.tiny:
            write_tiny_model(args.model)
        folder = model_folder(args.model)
        service = service_of(folder, name=args.name, device=args.device, lora_alpha=args.lora_alpha,
                             limits=limits, store=args.store)
        server = TinkerServer(service, port=args.port, key=key)
    except (ValueError, FileNotFoundError) as err:
        print(f"python3 -m purerl.tinker: {err}", file=sys.stderr)
        return 2
    print(f"serving {service.name} (base_model and cookbook model_name); checkpoints in {args.store}",
          file=sys.stderr, flush=True)
    print(server.banner(), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
