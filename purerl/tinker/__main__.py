"""``python3 -m purerl.tinker --model PATH``: serve the Tinker API over a local model on loopback.

Prints one line to export (``TINKER_BASE_URL=… TINKER_API_KEY=…``) on stdout, the model name that
clients pass as ``base_model`` on stderr, and serves until interrupted. ``PATH``: a Hugging Face
folder or a ``.gguf`` file (served from its converted folder; default SmolLM2-135M-Instruct's GGUF).
``--tiny`` first writes a tiny random Llama with a character tokenizer to ``PATH`` (a CPU demo).
"""

import argparse
import sys
import threading

from purerl.tinker.launch import DEFAULT_STORE, model_folder, service_of, write_tiny_model
from purerl.tinker.server import TinkerServer


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    parser = argparse.ArgumentParser(prog="python3 -m purerl.tinker", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face causal LM folder (with its tokenizer) or "
                        ".gguf file (default: SmolLM2-135M-Instruct's GGUF)")
    parser.add_argument("--name", default=None, help="the base_model name clients pass (default: the model's folder)")
    parser.add_argument("--lora-rank", type=int, default=None, help="the largest LoRA rank served (default: any)")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha: adapters scale by alpha / rank")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--store", default=str(DEFAULT_STORE), help="where tinker:// checkpoints are written")
    parser.add_argument("--tiny", action="store_true", help="write a tiny random Llama to --model first")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.tiny:
        if args.model is None:
            print("--tiny needs --model PATH (the folder to write)", file=sys.stderr)
            return 2
        write_tiny_model(args.model)
    try:
        folder = model_folder(args.model)
    except (ValueError, FileNotFoundError) as err:
        print(str(err), file=sys.stderr)
        return 2
    service = service_of(folder, name=args.name, device=args.device, lora_alpha=args.lora_alpha,
                         max_rank=args.lora_rank, store=args.store)
    server = TinkerServer(service, port=args.port)
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
