"""The `gpukit` command (also `python -m gpukit`).

    gpukit doctor    print the environment report and its warnings
    gpukit train     train a CNN headless and print its held-out accuracy and throughput

Bad input (an unsupported precision, missing CIFAR-10 files, a batch size of 0, …) ends with a
one-line `gpukit: error: …` on stderr and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import data, distributed, models
from .doctor import collect
from .env import detect, resolve_device, seed_everything
from .precision import PRECISIONS, get_precision
from .train import CheckpointError, History, NonFiniteLossError, fit

EXIT_BAD_INPUT = 2  # the same code argparse uses for a bad command line
EXIT_TRAINING_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C (128 + SIGINT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukit", description="Learn and measure fast neural-network training with PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{doctor,train}")

    doctor = commands.add_parser("doctor", help="report the environment and what looks wrong in it")
    doctor.set_defaults(handler=doctor_main)

    train = commands.add_parser(
        "train",
        help="train a CNN headless and print its accuracy and throughput",
        description="Train a CNN and print eval_accuracy=… images_per_second=… on the last line. "
        "Sizes left out come from the run profile (gpukit.detect(); override with GPUKIT_PROFILE).",
    )
    train.add_argument("--dataset", choices=("shapes", "cifar10"), default="shapes")
    train.add_argument("--data-dir", default="data", help="where CIFAR-10 is kept (default: data)")
    train.add_argument("--no-download", action="store_true", help="never download CIFAR-10; fail if it is missing")
    train.add_argument("--train-size", type=int, help="training images (shapes only; default: the profile's)")
    train.add_argument("--test-size", type=int, help="held-out images (shapes only; default: the profile's)")
    train.add_argument("--model", choices=("fast_cnn", "resnet18"), default="fast_cnn")
    train.add_argument("--width", type=int, help="base channel count of fast_cnn (default: the profile's)")
    train.add_argument("--epochs", type=int, help="default: the profile's")
    train.add_argument("--batch-size", type=int, help="per process under torchrun (default: the profile's)")
    train.add_argument("--lr", type=float, default=0.1, help="peak learning rate (default: 0.1, for batch 64)")
    train.add_argument("--precision", choices=PRECISIONS, default="fp32")
    train.add_argument("--device", default="auto", help="auto (the best present), cpu, cuda, cuda:N or mps")
    train.add_argument("--checkpoint-dir", help="save last.pt here after every epoch, and resume from it")
    train.add_argument("--augment", action="store_true", help="random crop and flip on the device")
    train.add_argument("--seed", type=int, default=0, help="seeds the weights, the order and the augmentation")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    train.set_defaults(handler=train_main)
    return parser


def doctor_main(args: argparse.Namespace) -> None:
    print(collect())


def _check_train_args(args: argparse.Namespace, sizes: dict[str, int]) -> None:
    """Raise ValueError for a bad combination or size, before any data is built."""
    if args.dataset == "cifar10" and (args.train_size is not None or args.test_size is not None):
        raise ValueError(
            "--train-size and --test-size apply to --dataset shapes only; CIFAR-10 uses its 50,000/10,000 split."
        )
    if args.model == "resnet18" and args.width is not None:
        raise ValueError("--width applies to --model fast_cnn only; leave it out for resnet18.")
    for flag, value in sizes.items():
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}.")
    if args.lr <= 0:
        raise ValueError(f"--lr must be positive, got {args.lr}.")


def train_main(args: argparse.Namespace) -> History:
    """Train as `args` (from `build_parser()`) ask, print the result, and return the History.

    Headless and non-interactive: it reads only `args` and the environment, so a launcher can
    run it unchanged in every worker. The last printed line is
    `eval_accuracy=0.912 images_per_second=2031` (held-out accuracy after the last epoch;
    median steady-state training throughput in images/s).
    """
    profile = detect().profile
    sizes = {
        "--train-size": args.train_size if args.train_size is not None else profile.train_size,
        "--test-size": args.test_size if args.test_size is not None else profile.test_size,
        "--width": args.width if args.width is not None else profile.width,
        "--epochs": args.epochs if args.epochs is not None else profile.epochs,
        "--batch-size": args.batch_size if args.batch_size is not None else profile.batch_size,
    }
    _check_train_args(args, sizes)
    if "WORLD_SIZE" in os.environ:  # started by torchrun (one or many machines) or gk.distributed.launch
        distributed.setup("gloo" if args.device == "cpu" else None)  # main() leaves the group at the end
    device = resolve_device(distributed.default_device() if args.device == "auto" else args.device)
    get_precision(args.precision, device)  # raises now if unsupported here, before any data is loaded

    if args.dataset == "shapes":
        # The dataset keeps its own fixed seed: runs with different --seed train on the same images.
        train, test = data.shapes(sizes["--train-size"], sizes["--test-size"])
    else:
        train, test = data.cifar10(args.data_dir, download=not args.no_download)
    seed_everything(args.seed)  # the model's initial weights
    model = models.fast_cnn(sizes["--width"]) if args.model == "fast_cnn" else models.resnet18()
    loader = data.DeviceLoader(train, sizes["--batch-size"], augment=args.augment, device=device, seed=args.seed)
    distributed.print0(
        f"training {args.model} on {args.dataset} ({len(train):,} train / {len(test):,} held-out images) "
        f"on {device}: precision={args.precision} epochs={sizes['--epochs']} batch_size={sizes['--batch-size']} "
        f"lr={args.lr} profile={profile.name}",
        flush=True,
    )
    history = fit(
        model,
        loader,
        epochs=sizes["--epochs"],
        lr=args.lr,
        precision=args.precision,
        device=device,
        eval_data=test,
        checkpoint_dir=args.checkpoint_dir,
        progress=not args.no_progress,
        seed=args.seed,
    )
    accuracy = history.final_eval_accuracy
    accuracy_text = "n/a" if accuracy is None else f"{accuracy:.3f}"
    distributed.print0(f"eval_accuracy={accuracy_text} images_per_second={history.images_per_second:.0f}", flush=True)
    return history


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `gpukit` command with `argv` (default: sys.argv[1:]) and return its exit code.

    A malformed command line (unknown option, not a number) exits through argparse, with code 2.
    """
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError, CheckpointError) as error:
        print(f"gpukit: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteLossError as error:
        print(f"gpukit: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except KeyboardInterrupt:
        print("gpukit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        distributed.cleanup()  # leave the process group, if `gpukit train` joined one
    return 0
