"""``python3 -m purerl.tinker --model PATH``: serve the Tinker API over a local model on loopback.

Prints one line to export (``TINKER_BASE_URL=… TINKER_API_KEY=…``) and serves until interrupted.
``--tiny`` first writes a tiny random Llama with a character tokenizer to ``PATH`` (a CPU demo).
"""

import argparse
import sys
import threading
from pathlib import Path

from purerl.tinker.launch import DEFAULT_STORE, service_of, write_tiny_model
from purerl.tinker.server import TinkerServer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m purerl.tinker", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face causal LM folder (with its tokenizer)")
    parser.add_argument("--name", default=None, help="the base_model name clients pass (default: --model as given)")
    parser.add_argument("--lora-rank", type=int, default=None, help="the largest LoRA rank served (default: any)")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha: adapters scale by alpha / rank")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--store", default=str(DEFAULT_STORE), help="where tinker:// checkpoints are written")
    parser.add_argument("--tiny", action="store_true", help="write a tiny random Llama to --model first")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        write_tiny_model(args.model)
    if not Path(args.model).is_dir():
        print(f"--model {args.model}: not a folder", file=sys.stderr)
        return 2
    service = service_of(args.model, name=args.name, device=args.device, lora_alpha=args.lora_alpha,
                         max_rank=args.lora_rank, store=args.store)
    server = TinkerServer(service, port=args.port)
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
