"""The augmented copy of a training utterance: sox speed + reverb, then additive noise.

``speed`` changes tempo and pitch together (like Kaldi's speed perturbation), so every gold
phone time is multiplied by ``1 / speed``; reverb and noise keep the times.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass

import numpy as np

from local.data.tts import SAMPLE_RATE


@dataclass(frozen=True)
class Augmentation:
    """One draw of the augmentation parameters.

    Attributes:
        speed: sox ``speed`` factor, 0.9–1.1.
        reverberance: sox ``reverb`` reverberance in %, 0 = no reverb.
        snr_db: signal-to-noise ratio of the added noise, 10–30 dB.
        noise_seed: seed of the noise generator.
    """

    speed: float
    reverberance: int
    snr_db: float
    noise_seed: int

    @staticmethod
    def draw(rng: random.Random) -> Augmentation:
        return Augmentation(
            speed=round(rng.uniform(0.9, 1.1), 3),
            reverberance=rng.choice([0, 0, 20, 40, 60]),
            snr_db=round(rng.uniform(10.0, 30.0), 1),
            noise_seed=rng.randrange(2**31),
        )

    def describe(self) -> str:
        return f"speed={self.speed} reverb={self.reverberance} snr_db={self.snr_db}"


def augment(audio: np.ndarray, aug: Augmentation) -> np.ndarray:
    """Apply ``aug`` to ``audio`` (``[num_samples]`` float32, 16 kHz); returns ``[num_samples']`` float32.

    The noise is low-pass coloured white noise, scaled so that the
    ratio of the speech power (over its non-silent samples) to the noise power is ``snr_db``.
    """
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16).tobytes()
    fmt = ["-t", "raw", "-r", str(SAMPLE_RATE), "-e", "signed", "-b", "16", "-c", "1"]
    # -R: sox dithers its 16-bit output with a random seed unless told to repeat itself
    cmd = ["sox", "-R", *fmt, "-", *fmt, "-", "speed", str(aug.speed), "rate", str(SAMPLE_RATE)]
    if aug.reverberance:
        cmd += ["reverb", str(aug.reverberance)]
    out = subprocess.run(cmd, input=pcm, capture_output=True, check=True).stdout
    y = np.frombuffer(out, dtype=np.int16).astype(np.float32) / 32768.0
    rng = np.random.default_rng(aug.noise_seed)
    white = rng.standard_normal(len(y)).astype(np.float32)
    # a one-pole low-pass (0.9) truncated to 32 taps tilts the spectrum towards low frequencies
    noise = np.convolve(white, 0.9 ** np.arange(32, dtype=np.float32), mode="same")
    loud = np.abs(y) > 0.02 * (np.abs(y).max() + 1e-9)
    speech_power = float(np.mean(y[loud] ** 2)) if loud.any() else float(np.mean(y**2) + 1e-12)
    noise_power = float(np.mean(noise**2)) + 1e-12
    noise *= np.sqrt(speech_power / noise_power / 10 ** (aug.snr_db / 10))
    return np.clip(y + noise, -1.0, 1.0).astype(np.float32)
