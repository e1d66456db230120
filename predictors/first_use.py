"""Predictors trained on first use (the default model): find calibration text, then `collect` + `train-predictor`.

Calibration text, first found wins:
  1. $FLASHINFER_LITE_CORPUS: a directory with the calibration files below (an error if it has none), or "builtin";
  2. ../shared/corpus next to the repository, or next to the working directory;
  3. the built-in calibration text shipped in this package (calibration.txt, written for the project).
From a corpus directory only the calibration splits are used, WikiText-2 validation and TinyStories, about half the
tokens from each: wikitext2_test.txt is what perplexity is evaluated on, so no predictor may see it.

The settings keep the default model within 3% of dense perplexity (docs/PREDICTORS.md, issue 14): thresholds at 40%
sparsity, predictors tuned to recall 0.99, and no predictor in a layer where it would select more than 90% of the
neurons anyway (train.DEFAULT_MAX_READ_SHARE), on few tokens so that first use takes minutes on two cores.
`generate` runs this module as a child process. Activations go to a temporary directory that is removed whatever
happens; the predictors land atomically (train.save_predictors), so an interrupted
first use leaves nothing behind and the next run starts over.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from storage.errors import UserError, child_exit_code
from flashinfer_lite.model import open_any
from flashinfer_lite.predictor_set import describe_calibration as describe, read_manifest
from storage.files import exclusive, remove_stale_temp_dirs, temp_path
from storage.predictor_files import PREDICTOR_DIR
from storage.tokenizer import corpus_chunks

from .acts import Acts, read_corpus
from .collect import collect
from .train import train

CORPUS_ENV = "FLASHINFER_LITE_CORPUS"
WIKITEXT = "wikitext2_valid.txt"
BUILTIN = "calibration.txt"


@dataclass(frozen=True)
class Calibration:
    tokens: int = 4096          # run through the dense model, in segments of ctx
    rows: int = 4096            # token rows kept per layer to train on (here: every token)
    ctx: int = 256
    sparsity: float = 0.4       # SwiGLU activation threshold: skip the smallest 40% of |a| (0.5 costs +2.7%)
    target_recall: float = 0.99 # at 0.9 the misses on unseen text cost SmolLM2 +26% perplexity
    steps: int = 300            # optimizer steps per layer
    dense_layers: int = 1


SETTINGS = Calibration()


def search_paths() -> list[Path]:
    """Where ../shared/corpus may be: next to the repository this package runs from, and next to the cwd."""
    repo = Path(__file__).resolve().parents[1]
    return [repo.parent / "shared" / "corpus", Path.cwd().parent / "shared" / "corpus"]


def calibration_files(d: Path) -> list[Path]:
    """The calibration files of a corpus directory: WikiText-2 validation, then one TinyStories file (cased first)."""
    if not d.is_dir():
        return []
    files = [d / WIKITEXT] if (d / WIKITEXT).is_file() else []
    stories = sorted(d.glob("tinystories*cased*.txt")) or sorted(d.glob("tinystories*.txt"))
    return files + stories[:1]


def find_corpus() -> tuple[Path, list[Path]] | None:
    """(directory, calibration files), or None when no corpus is around (the built-in text is used then)."""
    env = os.environ.get(CORPUS_ENV)
    if env == "builtin":
        return None
    if env:
        d = Path(env).expanduser()
        files = calibration_files(d)
        if not files:
            raise UserError(f"${CORPUS_ENV} is {env}, which holds no calibration text ({WIKITEXT} or "
                            f"tinystories*.txt); unset it to use ../shared/corpus or the built-in text")
        return d.resolve(), files
    for d in search_paths():
        files = calibration_files(d)
        if files:
            return d.resolve(), files
    return None


def builtin_text() -> str:
    return (resources.files(__package__) / BUILTIN).read_text(encoding="utf-8")


def head_tokens(text: str, tokenizer, n: int) -> str:
    """The shortest prefix of whole lines holding at least n tokens (all of text if it has fewer)."""
    got = end = 0
    for chunk in corpus_chunks(text, chunk_chars=4096):
        got += len(tokenizer.encode(chunk, add_special_tokens=False))
        end += len(chunk)
        if got >= n:
            break
    return text[:end]


def mixed_text(files: list[Path], tokenizer, n_tokens: int) -> str:
    """An equal share of tokens from each file but the last, then all of the last: collect stops after n_tokens, and
    reading the files one after the other would fill every segment from the first file alone."""
    share = -(-n_tokens // len(files))
    parts = [head_tokens(read_corpus([f]).text, tokenizer, share) for f in files[:-1]]
    return "\n".join(parts + [read_corpus([files[-1]]).text])


def say(msg: str) -> None:
    print(msg, file=sys.stderr)


def idle_cores() -> int:
    """Cores not already busy (1-minute load average), at least 1. On a shared machine, BLAS and torch threads that
    spin waiting for a busy core made collection 4x and training 5-7x slower than a single thread (measured here)."""
    return max(1, (os.cpu_count() or 1) - int(os.getloadavg()[0] + 0.5))


def blas_threads(n: int):
    """numpy's BLAS limited to n threads inside the block (threadpoolctl comes with the train extra's scikit-learn)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        from contextlib import nullcontext
        return nullcontext()
    return threadpool_limits(n, user_api="blas")


def say_time_left(n_layers: int):
    """train's on_layer: once the first layer that trains a predictor is done, one line with the time the others
    will take at its pace (the layers are the same size), and the bar's estimate of the time left from then on."""
    said = False

    def on_layer(card: dict, bar) -> None:
        nonlocal said
        if said or "seconds" not in card:
            return
        said = True
        left = card["seconds"] * (n_layers - card["layer"] - 1)
        done_at = time.strftime("%H:%M", time.localtime(time.time() + left))
        tqdm.write(f"predictors: {card['seconds']:.0f} s per layer; the {n_layers - card['layer'] - 1} layers left "
                   f"take about {left / 60:.0f} min (until {done_at})", file=sys.stderr)
        bar.set_description(f"train-predictor (~{left / 60:.0f} min)")
    return on_layer


def ensure_predictors(flashdir, settings: Calibration | None = None, progress: bool = True) -> dict | None:
    """Train FLASHDIR's predictors unless it has them. Returns the manifest's calibration record (None for predictors
    trained by hand with `train-predictor`)."""
    m = read_manifest(flashdir)          # the manifest only: the weights are the runtime's to load
    if m is not None and m.get("has_predictors"):
        return m.get("calibration")
    try:
        import torch  # noqa: F401  (training only; the runtime never imports it)
    except ImportError:
        raise UserError("training the default model's predictors on first use needs torch: "
                        "pip install 'flashinfer-lite[train]' (or run with --ffn dense)") from None


    settings = settings or SETTINGS
    flashdir = Path(flashdir)
    found = find_corpus()
    if found:
        where, files = found
        record = {"source": "corpus", "path": str(where), "files": [f.name for f in files]}
        source = f"{where} ({', '.join(record['files'])})"
    else:
        record = {"source": "builtin", "path": f"{__package__}/{BUILTIN}", "files": [BUILTIN]}
        source = "the built-in calibration text (no ../shared/corpus found)"
    t0 = time.perf_counter()
    threads = idle_cores()
    say(f"predictors: none yet; training them once, on first use, from {source} with {threads} thread(s)")
    remove_stale_temp_dirs(flashdir.parent)           # what a killed first use left behind
    work = temp_path(flashdir, "calibrate")             # .NAME.calibrate-PID: the next run knows whose it is
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        with blas_threads(threads):
            text = work / "calibration.txt"
            if found:
                text.write_text(mixed_text(files, open_any(flashdir).tokenizer(), settings.tokens), encoding="utf-8")
            else:
                text.write_text(builtin_text(), encoding="utf-8")
            acts = collect(flashdir, [text], settings.tokens, work / "acts", ctx=settings.ctx, rows=settings.rows,
                           progress=progress)
            record["tokens"] = int(Acts(acts).tokens)
            record["trained_on_first_use"] = True
            record["settings"] = asdict(settings)
            train(acts, flashdir, target_recall=settings.target_recall, sparsity=settings.sparsity,
                  steps=settings.steps, dense_layers=settings.dense_layers, progress=progress, calibration=record,
                  threads=threads, on_layer=say_time_left(Acts(acts).config.n_layers))
    except OSError as e:     # a full disk: one line naming where (a write() error names no file)
        raise UserError(f"cannot write {e.filename or work}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"predictors: trained on first use from {describe(record)} in {time.perf_counter() - t0:.0f} s, "
        f"saved in {flashdir / 'predictors'}")
    return record


def ensure_predictors_once(flashdir) -> dict | None:
    """ensure_predictors, one process at a time per FLASHDIR: a concurrent first use waits, then finds them."""
    with exclusive(Path(flashdir) / PREDICTOR_DIR, "first-use training"):
        return ensure_predictors(flashdir, progress=sys.stderr.isatty())


def main(argv: list[str] | None = None) -> int:
    """`python -m predictors.first_use FLASHDIR`: what `generate` runs, as a child process, when the default model has
    no predictors yet, so the inference process never imports torch and training has every core."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m predictors.first_use FLASHDIR", file=sys.stderr)
        return 2
    return child_exit_code(lambda: ensure_predictors_once(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
