"""Reading videos (a file via PyAV, or a directory of frame images) and images, with uniform frame sampling.

    video = read_video("clip.mp4", frames=8)   # Video(frames (8, H, W, 3) uint8, fps, indices, total_frames)
    video.metadata()                           # transformers VideoMetadata -> the processor's real fps

The sampled frames keep their timing: `VideoMetadata(fps=native fps, total_num_frames, frames_indices)`
gives the processor `sampled_fps = len(indices) / total * fps`, which Qwen2.5-VL turns into the temporal
M-RoPE step (`second_per_grid_ts`). Without it the processor assumes 24 fps and collapses the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
FRAME_DIR_FPS = 2.0
"""Assumed frame rate of a directory of frames (it carries none): Qwen2.5-VL's usual 2 fps sampling rate."""


@dataclass(frozen=True)
class Video:
    """Sampled frames of one video and where they came from."""

    frames: np.ndarray  # (T, H, W, 3) uint8 RGB
    fps: float  # native frame rate of the source
    indices: tuple[int, ...]  # [T] source frame index of each sampled frame
    total_frames: int  # frames in the source

    def __post_init__(self) -> None:
        assert self.frames.ndim == 4 and self.frames.shape[-1] == 3 and self.frames.dtype == np.uint8, (
            f"Video.frames must be (T, H, W, 3) uint8, got {self.frames.shape} {self.frames.dtype}")
        assert len(self.indices) == self.frames.shape[0], (len(self.indices), self.frames.shape)

    def metadata(self):
        """The transformers VideoMetadata a processor needs for the sampled frames' real timing."""
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(total_num_frames=self.total_frames, fps=self.fps, frames_indices=list(self.indices),
                             duration=self.total_frames / self.fps, height=int(self.frames.shape[1]),
                             width=int(self.frames.shape[2]))

    def subsample(self, num_frames: int) -> Video:
        """`num_frames` of these frames, sampled uniformly; source indices and timing kept."""
        keep = sample_indices(len(self.indices), num_frames)
        return Video(self.frames[list(keep)], self.fps, tuple(self.indices[i] for i in keep), self.total_frames)

    @staticmethod
    def from_array(frames: np.ndarray, fps: float = FRAME_DIR_FPS, num_frames: int | None = None) -> Video:
        """Wrap (T, H, W, 3) uint8 frames (e.g. synthetic), optionally sampling `num_frames` of them."""
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise UserError(f"video: expected a (T, H, W, 3) uint8 array, got shape {frames.shape} {frames.dtype}")
        if frames.shape[0] == 0:
            raise UserError("video: the array has no frames")
        indices = sample_indices(frames.shape[0], frames.shape[0] if num_frames is None else num_frames)
        return Video(frames[list(indices)], float(fps), indices, frames.shape[0])


def check_num_frames(frames: int) -> None:
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 1:
        raise UserError(f"frames must be an integer >= 1, got {frames!r}")


def sample_indices(total: int, frames: int) -> tuple[int, ...]:
    """`min(frames, total)` indices spread uniformly over [0, total): the centre of each of equal segments.

    Example: total 10, frames 4 -> segments of 2.5 -> (1, 3, 6, 8).
    """
    check_num_frames(frames)
    if total < 1:
        raise UserError("video has no frames")
    n = min(int(frames), total)
    return tuple(int(i) for i in ((np.arange(n) + 0.5) * total / n).astype(np.int64))


def _read_frame_dir(directory: Path, frames: int, fps: float) -> Video:
    from PIL import Image

    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"video: directory {str(directory)!r} holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
    indices = sample_indices(len(files), frames)
    images = []
    for i in indices:
        try:
            with Image.open(files[i]) as im:
                images.append(np.asarray(im.convert("RGB")))
        except OSError as e:
            raise UserError(f"video: cannot read frame {str(files[i])!r}: {e}") from None
    if len({im.shape for im in images}) > 1:
        raise UserError(f"video: frames in {str(directory)!r} differ in size")
    return Video(np.stack(images), fps, indices, len(files))


def _read_video_file(path: Path, frames: int) -> Video:
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise UserError(f"video: {str(path)!r} has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 24.0
            total = stream.frames  # 0 when the container does not record it: count by decoding
            if total <= 0:
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total <= 0:
                raise UserError(f"video: {str(path)!r} has no frames")
            indices = sample_indices(total, frames)
            wanted, picked = set(indices), {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    picked[i] = frame.to_ndarray(format="rgb24")
                if i >= indices[-1]:
                    break
    except av.error.FFmpegError as e:
        raise UserError(f"video: cannot read {str(path)!r} as a video: {e}") from None
    if not picked:
        raise UserError(f"video: {str(path)!r} has no decodable frames")
    found = tuple(i for i in indices if i in picked)  # the frame count in the header may overstate
    return Video(np.stack([picked[i] for i in found]), fps, found, total)


def read_video(source: str | Path, frames: int = 8, fps: float = FRAME_DIR_FPS) -> Video:
    """`frames` frames sampled uniformly from a video file or a directory of frame images (sorted by name).

    `fps` is only used for a directory (a file carries its own frame rate).
    Raises ValueError naming `video` / `frames` for a missing, unreadable or empty source.
    """
    check_num_frames(frames)
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"video: no such file or directory: {str(source)!r}")
    if path.is_dir():
        return _read_frame_dir(path, frames, fps)
    return _read_video_file(path, frames)


def read_image(source: str | Path):
    """A PIL RGB image from a file; ValueError naming `image` if it is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    path = Path(source).expanduser()
    if not path.is_file():
        raise UserError(f"image: no such file: {str(source)!r}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"image: cannot read {str(source)!r} as an image: {e}") from None


def check_media_args(video: str | None, frames: int | None, images: list[str] | None) -> None:
    """Cheap checks of the CLI's --video/--frames/--image, run before any model is loaded."""
    if frames is not None:
        check_num_frames(frames)
        if video is None:
            raise UserError("frames: given without a video (--video)")
    if video is not None and not Path(video).expanduser().exists():
        raise UserError(f"video: no such file or directory: {video!r}")
    for image in images or ():
        if not Path(image).expanduser().is_file():
            raise UserError(f"image: no such file: {image!r}")
