"""Datasets and loaders: images, text, your own files; loaders that keep data on the device.

images.py    `ImageDataset` (images as one uint8 tensor), `shapes()` (synthetic, with boxes), `cifar10()`;
             `DetectionDataset` (images with boxes, as a detector takes them)
folder.py    `image_folder()`: your own JPEG/PNG files in class folders, decoded once and cached
text.py      `text()`: byte tokens of local text files; `TokenDataset`; `TextLoader`
loaders.py   `DeviceLoader` (images on the device, augmented there) and `dataloader()` (PyTorch's);
             `collate_lists` (detection batches as lists)
formats.py   the same images as files, as one uint8 array (memory-mapped); read throughput cold and warm
shards.py    `write_shards()`, `ShardLoader`: WebDataset tar shards streamed through DataLoader workers
decoding.py  JPEG decoding with PIL, torchvision on the CPU or the GPU, augmentation in workers or batched
prefetch.py  `prefetch()`: copy the next batch to the GPU on a side stream while the step runs
timeline.py  `trace_steps()`: a torch.profiler trace of the pipeline, drawn by `plot_trace()`
pagecache.py evict files from the page cache and measure how much of them it holds
bottleneck.py `diagnose()`: input-bound or compute-bound, and what to try
loader_timing.py  a loader timed alone; `sweep()` over DataLoader workers; `SlowDataset`
"""

from ..deprecation import renamed
from .bottleneck import Diagnosis, diagnose
from .decoding import decode_batch, decode_table
from .folder import image_folder
from .formats import ArrayImages, FileImages, read_throughput, write_array, write_files
from .images import CIFAR10_CLASSES, CIFAR10_URL, SHAPE_CLASSES, DetectionDataset, ImageDataset, cifar10, shapes
from .loader_timing import SlowDataset, plot_sweep, sweep
from .loaders import DeviceLoader, collate_lists, dataloader, random_crop_flip, worker_crash
from .prefetching import CUDAPrefetcher, prefetch
from .shards import ShardError, ShardLoader, write_shards
from .timeline import Trace, plot_trace, trace_steps
from .tokens import VOCAB_SIZE, TextLoader, TokenDataset, decode, encode, text

__all__ = [
    "ArrayImages",
    "CIFAR10_CLASSES",
    "CIFAR10_URL",
    "CUDAPrefetcher",
    "DetectionDataset",
    "DeviceLoader",
    "Diagnosis",
    "FileImages",
    "ImageDataset",
    "SHAPE_CLASSES",
    "ShardError",
    "ShardLoader",
    "SlowDataset",
    "TextLoader",
    "TokenDataset",
    "Trace",
    "VOCAB_SIZE",
    "cifar10",
    "collate_lists",
    "dataloader",
    "decode",
    "decode_batch",
    "decode_table",
    "diagnose",
    "encode",
    "image_folder",
    "plot_sweep",
    "plot_trace",
    "prefetch",
    "random_crop_flip",
    "read_throughput",
    "shapes",
    "sweep",
    "text",
    "trace_steps",
    "write_array",
    "write_files",
    "worker_crash",
    "write_shards",
]

__getattr__ = renamed(__name__, {"plot_timeline": "gpukit.data.timeline:plot_trace"})
