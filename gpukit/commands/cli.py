"""The `gpukit` command (also `python -m gpukit`).

    gpukit doctor    print the environment report and its warnings; exit code 1 where what the lessons
                     import fails (a torch/torchvision pair that does not belong together): make setup ends with it
    gpukit train     train headless (a CNN on images, or a small GPT on text) and print the
                     held-out result and the throughput
    gpukit lab DIR   open the lessons in DIR in JupyterLab (copied there first if DIR has none)
    gpukit gpu-check run the gpu tests, every lesson (gpu profile) and every benchmark on a CUDA GPU;
                     append the results to benchmarks/RESULTS.md and print a summary (gpukit/gpucheck.py)
    gpukit site DIR  run every lesson and write a static site of the results into DIR (make site;
                     gpukit/site.py), or publish lessons already executed (--from)
    gpukit nbval-sanitize-path
                     print the path of the sanitize file for strict nbval (docs/nbval.md)

Bad input (an unsupported precision, missing CIFAR-10 files, a batch size of 0, …) ends with a
one-line `gpukit: error: …` on stderr and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import data, distributed, models, shipped
from ..checkup import collect
from ..env import PROFILES, detect, resolve_device, seed_everything
from ..precision import PRECISIONS, get_precision
from ..preemption import EXIT_PREEMPTED, Preempted, sigterm_raises
from ..train import CheckpointError, History, NonFiniteLossError, fit
from ..train.checks import check_checkpoint_dir
from ..validation import check_seed
from . import gpucheck, gpulease, jupyter, nbval

DATASETS = ("shapes", "cifar10", "folder", "text")
MODELS = ("fast_cnn", "resnet18", "gpt")
EXIT_BAD_INPUT = 2  # the same code argparse uses for a bad command line
EXIT_TRAINING_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C (128 + SIGINT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukit", description="Learn and measure fast neural-network training with PyTorch."
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{doctor,train,lessons,lab,gpu-check,site,nbval-sanitize-path}"
    )

    doctor = commands.add_parser(
        "doctor",
        help="report the environment and what looks wrong in it; exit code 1 where what the lessons import fails",
    )
    doctor.set_defaults(handler=doctor_main)

    train = commands.add_parser(
        "train",
        help="train a CNN on images or a small GPT on text, and print the result and throughput",
        description="Train and print the held-out result and throughput on the last line: eval_accuracy=… "
        "images_per_second=… for images, eval_loss=… tokens_per_second=… for text. Sizes left out come from the "
        "run profile (gpukit.detect(); override with GPUKIT_PROFILE).",
    )
    train.add_argument(
        "--dataset",
        choices=DATASETS,
        default="shapes",
        help="shapes (synthetic), cifar10, folder (your images in class folders), text (byte tokens)",
    )
    train.add_argument(
        "--data-dir",
        help="cifar10: where it is kept (default: data); folder: the folder of class subfolders (required); "
        "text: a text file or folder (default: the Python standard library's source)",
    )
    train.add_argument("--no-download", action="store_true", help="never download CIFAR-10; fail if it is missing")
    train.add_argument("--train-size", type=int, help="training images (shapes only; default: the profile's)")
    train.add_argument("--test-size", type=int, help="held-out images (shapes only; default: the profile's)")
    train.add_argument("--image-size", type=int, default=32, help="folder only: images become N×N (default: 32)")
    train.add_argument("--seq-len", type=int, help="text only: tokens per window (default: the profile's)")
    train.add_argument(
        "--model", choices=MODELS, help="fast_cnn or resnet18 for images (default fast_cnn); gpt for text"
    )
    train.add_argument("--width", type=int, help="channels of fast_cnn, or width of gpt (default: the profile's)")
    train.add_argument("--epochs", type=int, help="default: the profile's")
    train.add_argument("--batch-size", type=int, help="per process under torchrun (default: the profile's)")
    train.add_argument(
        "--lr", type=float, help="peak learning rate (default: 0.1 with SGD for CNNs, 3e-3 with AdamW for gpt)"
    )
    train.add_argument("--precision", choices=PRECISIONS, default="fp32")
    train.add_argument("--device", default="auto", help="auto (the best present), cpu, cuda, cuda:N or mps")
    train.add_argument("--checkpoint-dir", help="save last.pt here after every epoch, and resume from it")
    train.add_argument(
        "--save-every", type=int, metavar="N", help="also save every N optimizer steps (needs --checkpoint-dir)"
    )
    train.add_argument("--augment", action="store_true", help="random crop and flip on the device (images)")
    train.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the initial weights (Python's, NumPy's and torch's generators, before the model is built), the "
        "order of the training data and its augmentation, and torch's generator in training (dropout; fit(seed=)). "
        "The data itself does not depend on it: the synthetic shapes and a folder's held-out split have fixed seeds "
        "(default: 0)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    train.set_defaults(handler=train_main)

    _add_lessons(commands)
    _add_lab(commands)
    _add_gpu_check(commands)
    _add_site(commands)

    sanitize = commands.add_parser(
        "nbval-sanitize-path",
        help="print the path of gpukit's sanitize file for strict nbval (--nbval-sanitize-with)",
        description="Print the path of the sanitize file that masks gpukit's run-to-run figures (times, "
        "throughputs, memory, progress bars) for `pytest --nbval --nbval-sanitize-with=PATH`.",
    )
    sanitize.set_defaults(handler=lambda args: print(nbval.sanitize_path()))
    return parser


def _add_lessons(commands) -> None:
    """The `lessons` command: a copy of the lessons to open and edit (gpukit/shipped.py)."""
    lessons = commands.add_parser(
        "lessons",
        help="copy the lessons (notebooks) into a folder, to open and edit them after a pip install",
        description="Copy gpukit's lesson notebooks into DIR (made if missing). Lessons already there are kept "
        "unless --force. Then: gpukit lab DIR.",
    )
    lessons.add_argument("dir", metavar="DIR", help="the folder to copy them into, e.g. gpukit-lessons")
    lessons.add_argument("--force", action="store_true", help="replace lessons already in DIR")
    lessons.set_defaults(handler=lessons_main)


def _add_lab(commands) -> None:
    """The `lab` command: JupyterLab on a folder of lessons, as root too (gpukit/jupyter.py)."""
    lab = commands.add_parser(
        "lab",
        help="open the lessons in JupyterLab (copying them into DIR first if it has none)",
        description="Open DIR in JupyterLab with gpukit's save hook (a lesson opened and closed stays unchanged). "
        "A DIR without lessons gets a copy of them first. As root, --allow-root is added. Options after DIR go to "
        "JupyterLab, e.g. gpukit lab gpukit-lessons --ip=0.0.0.0 --port=8888 --no-browser.",
    )
    lab.add_argument("dir", metavar="DIR", help="the folder of lessons, e.g. gpukit-lessons")
    lab.add_argument("options", nargs=argparse.REMAINDER, help="options for JupyterLab")
    lab.set_defaults(handler=lab_main)


def _add_gpu_check(commands) -> None:
    """The `gpu-check` command (gpukit/gpucheck.py), whose handler returns the exit code."""
    check = commands.add_parser(
        "gpu-check",
        help="verify gpukit on a CUDA GPU: gpu tests, every lesson, every benchmark; results to benchmarks/RESULTS.md",
        description="Run the tests marked gpu, every lesson under nbval in the gpu profile and every benchmark with "
        "--device cuda, each under its own time limit (28 min in all at most); append a dated section to "
        f"benchmarks/RESULTS.md and print a summary. Exit code 0, {gpucheck.EXIT_FAILED} if something failed, "
        f"{gpucheck.EXIT_NO_GPU} where there is no CUDA GPU (then nothing runs).",
    )
    check.add_argument(
        "--steps",
        default=",".join(gpucheck.STEPS),
        help=f"comma-separated, of {','.join(gpucheck.STEPS)} (default: all)",
    )
    check.add_argument("--results", type=Path, help="the Markdown file to append to (default: benchmarks/RESULTS.md)")
    check.add_argument("--log-dir", type=Path, help="default: runs/gpu-check/DATE-TIME in the checkout")
    check.add_argument(
        "--only",
        help="comma-separated starts of gpu test file, lesson and benchmark names to run, in that order "
        "(e.g. test_memory,03,06,fit_overhead)",
    )
    check.add_argument("--seconds", type=float, help="the whole check's time limit, for a short lease")
    _add_budget_options(check)
    check.set_defaults(handler=gpu_check_main)


def _add_budget_options(check) -> None:
    """gpu-check --budget and its company (gpukit/gpulease.py): a check planned from benchmarks/gpu-ledger.json."""
    check.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="run what is due in the ledger (never run on a GPU, failed, or changed since), most valuable first, "
        "ending within SECONDS in all; record each in benchmarks/gpu-ledger.json (ignores --steps and --seconds)",
    )
    check.add_argument(
        "--dry-run", action="store_true", help="with --budget: print the plan, run nothing (no GPU needed)"
    )
    check.add_argument("--leases", type=int, default=1, help="with --dry-run: plan this many leases in a row")
    check.add_argument(
        "--gpu", default="NVIDIA H200", help="with --dry-run: the GPU the plan is for (the lent machines: an H200)"
    )
    check.add_argument(
        "--out", type=Path, help="with --budget: write results.md, summary.txt, the ledger and logs here"
    )
    check.add_argument(
        "--collect",
        type=Path,
        metavar="DIR",
        help="run nothing: append DIR/results.md to RESULTS.md and merge DIR/gpu-ledger.json into the ledger",
    )


def gpu_check_main(args: argparse.Namespace) -> int:
    only = args.only.split(",") if args.only else None
    if args.collect:
        if args.budget is not None or args.dry_run:
            raise ValueError("gpu-check --collect runs nothing: give it without --budget and --dry-run.")
        return gpulease.collect(args.collect, args.results)
    if args.budget is not None:
        return gpulease.run_budget_check(
            args.budget,
            only=only,
            leases=args.leases,
            dry_run=args.dry_run,
            out=args.out,
            log_dir=args.log_dir,
            results_path=args.results,
            gpu=args.gpu,
        )
    if args.dry_run or args.out or args.leases != 1:  # else the whole 29-minute check would start
        raise ValueError(
            "gpu-check --dry-run, --out and --leases plan or write a budgeted check: give --budget SECONDS."
        )
    return gpucheck.run_gpu_check(args.steps.split(","), args.results, args.log_dir, only=only, seconds=args.seconds)


def _add_site(commands) -> None:
    """The `site` command (gpukit/site.py), whose handler returns the exit code."""
    site = commands.add_parser(
        "site",
        help="run every lesson and build a static site of the results (make site)",
        description="Run every lesson top to bottom in a fresh kernel and write DIR/index.html and a page per lesson "
        "with its outputs, figures and each check's outcome; or, with --from, publish lessons already executed. "
        "Exit code 1, naming the lesson and cell, if a lesson raised an error, left a cell unrun or showed no figure.",
    )
    site.add_argument(
        "dir", metavar="DIR", type=Path, help="the folder to write, e.g. _site (its old pages are replaced)"
    )
    source = site.add_mutually_exclusive_group()
    source.add_argument(
        "--from",
        dest="executed",
        metavar="EXECUTED",
        type=Path,
        help="a folder of executed lessons to publish, running nothing (make gpu-check keeps them in "
        "runs/gpu-check/DATE-TIME/notebooks)",
    )
    source.add_argument("--lessons", type=Path, help="the folder of lessons to run (default: gpukit's own)")
    site.add_argument(
        "--profile",
        choices=PROFILES,
        help="the sizes to run the lessons at (default: GPUKIT_PROFILE, else gpukit's choice for this machine)",
    )
    site.add_argument("--cell-timeout", type=float, default=600, help="seconds one cell may run (default: 600)")
    site.set_defaults(handler=site_main)


def site_main(args: argparse.Namespace) -> int:
    # nbconvert takes seconds to import and comes with the dev extra only: loaded when `gpukit site` runs.
    try:
        from . import site
    except ImportError as error:
        print(f"gpukit: error: gpukit site needs nbconvert ({error}): pip install nbconvert", file=sys.stderr)
        return EXIT_BAD_INPUT
    return site.main(args.dir, args.lessons, args.executed, args.profile, args.cell_timeout)


def doctor_main(args: argparse.Namespace) -> int:
    report = collect()
    print(report)
    return 1 if report.broken else 0


def _check_train_args(args: argparse.Namespace, sizes: dict[str, int]) -> None:
    """Raise ValueError for a bad combination or size, before any data is built."""
    text = args.dataset == "text"
    if args.dataset != "shapes" and (args.train_size is not None or args.test_size is not None):
        raise ValueError(f"--train-size and --test-size apply to --dataset shapes only, not {args.dataset}.")
    if text != (args.model == "gpt"):
        raise ValueError("--model gpt trains on --dataset text, and text trains --model gpt; pass both or neither.")
    if args.model == "resnet18" and args.width is not None:
        raise ValueError("--width applies to --model fast_cnn or gpt only; leave it out for resnet18.")
    if args.dataset == "folder" and args.data_dir is None:
        raise ValueError("--dataset folder needs --data-dir PATH: a folder with one subfolder of images per class.")
    if args.seq_len is not None and not text:
        raise ValueError("--seq-len applies to --dataset text only.")
    if args.augment and text:
        raise ValueError("--augment (random crop and flip) applies to images, not text.")
    for flag, value in sizes.items():
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}.")
    if args.lr is not None and args.lr <= 0:
        raise ValueError(f"--lr must be positive, got {args.lr}.")
    check_seed(args.seed, "--seed")
    # A file, or a folder that cannot be written, is said now: not after the data is built and an epoch trained.
    check_checkpoint_dir(args.checkpoint_dir, "--checkpoint-dir")


def _data(args: argparse.Namespace, sizes: dict[str, int], device):
    """(training data for fit, held-out data, a description) for --dataset."""
    if args.dataset == "shapes":
        # The dataset keeps its own fixed seed: runs with different --seed train on the same images.
        train, test = data.shapes(sizes["--train-size"], sizes["--test-size"])
    elif args.dataset == "cifar10":
        train, test = data.cifar10(args.data_dir or "data", download=not args.no_download)
    elif args.dataset == "folder":
        train, test = data.image_folder(args.data_dir, args.image_size, progress=not args.no_progress).split(0.2)
    else:
        profile = detect().profile
        train, test = data.text(args.data_dir, seq_len=sizes["--seq-len"], max_bytes=profile.text_bytes)
        loader = data.TextLoader(train, sizes["--batch-size"], device=device, seed=args.seed)
        return loader, test, f"{len(train.tokens):,} train / {len(test.tokens):,} held-out byte tokens"
    loader = data.DeviceLoader(train, sizes["--batch-size"], augment=args.augment, device=device, seed=args.seed)
    return loader, test, f"{len(train):,} train / {len(test):,} held-out images of {len(train.classes)} classes"


def _model(args: argparse.Namespace, sizes: dict[str, int], classes: int):
    if args.model == "gpt":
        profile = detect().profile
        return models.gpt(
            max_seq_len=sizes["--seq-len"], width=sizes["--width"], depth=profile.gpt_depth, heads=profile.gpt_heads
        )
    if args.model == "resnet18":
        return models.resnet18(classes)
    return models.fast_cnn(sizes["--width"], classes)


def train_main(args: argparse.Namespace) -> History:
    """Train as `args` (from `build_parser()`) ask, print the result, and return the History.

    Headless and non-interactive: it reads only `args` and the environment, so a launcher can
    run it unchanged in every worker. The last printed line is
    `eval_accuracy=0.912 images_per_second=2031` for images (held-out accuracy after the last
    epoch; median steady-state throughput), `eval_loss=1.52 tokens_per_second=40213` for text.
    """
    profile = detect().profile
    args.model = args.model or ("gpt" if args.dataset == "text" else "fast_cnn")
    text = args.dataset == "text"
    sizes = {
        "--train-size": args.train_size if args.train_size is not None else profile.train_size,
        "--test-size": args.test_size if args.test_size is not None else profile.test_size,
        "--width": args.width if args.width is not None else (profile.gpt_width if text else profile.width),
        "--epochs": args.epochs if args.epochs is not None else profile.epochs,
        "--batch-size": args.batch_size if args.batch_size is not None else profile.batch_size,
        "--image-size": args.image_size,
        "--seq-len": args.seq_len if args.seq_len is not None else profile.seq_len,
    }
    _check_train_args(args, sizes)
    if "WORLD_SIZE" in os.environ:  # started by torchrun (one or many machines) or gk.distributed.launch
        distributed.setup("gloo" if args.device == "cpu" else None)  # main() leaves the group at the end
    device = resolve_device(distributed.default_device() if args.device == "auto" else args.device)
    get_precision(args.precision, device)  # raises now if unsupported here, before any data is loaded

    loader, test, described = _data(args, sizes, device)
    seed_everything(args.seed)  # the model's initial weights
    model = _model(args, sizes, 0 if text else len(test.classes))
    lr = args.lr if args.lr is not None else (3e-3 if text else 0.1)
    distributed.print0(
        f"training {args.model} on {args.dataset} ({described}) on {device}: precision={args.precision} "
        f"epochs={sizes['--epochs']} batch_size={sizes['--batch-size']} lr={lr} profile={profile.name}",
        flush=True,
    )
    history = fit(
        model,
        loader,
        epochs=sizes["--epochs"],
        lr=lr,
        optimizer="adamw" if text else "nesterov",
        weight_decay=0.1 if text else 5e-4,
        precision=args.precision,
        device=device,
        eval_data=test,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        progress=not args.no_progress,
        seed=args.seed,
    )
    if text:
        result = f"eval_loss={_number(history.final_eval_loss, '.3f')} tokens_per_second={_number(history.tokens_per_second, '.0f')}"
    else:
        result = f"eval_accuracy={_number(history.final_eval_accuracy, '.3f')} images_per_second={_number(history.images_per_second, '.0f')}"
    distributed.print0(result, flush=True)
    return history


def lessons_main(args: argparse.Namespace) -> None:
    copies = shipped.copy_lessons(args.dir, overwrite=args.force, name="DIR")
    print(f"copied {len(copies)} lessons to {Path(args.dir).resolve()}; open them with: gpukit lab {args.dir}")


def lab_main(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("jupyterlab") is None:
        raise FileNotFoundError(
            "JupyterLab is not installed in this Python: pip install 'gpukit[lab]' (or jupyterlab), then run this again"
        )
    folder = Path(args.dir)
    if not list(folder.glob("[0-9][0-9]*_*.ipynb")):
        copies = shipped.copy_lessons(folder, name="DIR")
        print(f"copied {len(copies)} lessons to {folder.resolve()}")
    if jupyter.running_as_root():
        print("running as root: JupyterLab starts with --allow-root")
    command = jupyter.lab_command(folder, args.options)
    sys.stdout.flush()
    os.execv(command[0], command)  # JupyterLab takes this process over: Ctrl-C reaches it, not us


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `gpukit` command with `argv` (default: sys.argv[1:]) and return its exit code.

    A malformed command line (unknown option, not a number) exits through argparse, with code 2.
    `train` stopped by SIGTERM (a scheduler preempting the job, torchrun stopping its workers) ends with one line
    saying which save resumes it, and code 143.
    """
    args = build_parser().parse_args(argv)
    try:
        with sigterm_raises() if args.command == "train" else contextlib.nullcontext():
            code = args.handler(args)  # gpu-check returns its exit code; the others return None or a History
    except Preempted as error:
        said = " ".join(getattr(error, "__notes__", [])) or "it was stopped before training started"
        resume = " Run the same command again to resume." if getattr(args, "checkpoint_dir", None) else ""
        sys.stderr.write(f"gpukit: {_one_line(error)}: {_one_line(said)}{resume}\n")  # one write: workers share stderr
        return EXIT_PREEMPTED
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as error:
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
    return code if isinstance(code, int) else 0
