"""Progress output: a tqdm bar on a terminal, one plain line per driver call elsewhere."""
from __future__ import annotations


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int, out):
        self.total, self.out = total, out
        self.bar = None
        if hasattr(out, "isatty") and out.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=out, unit="step", dynamic_ncols=True)

    def update(self, rec: dict, elapsed: float) -> None:
        done = rec["step"] + 1
        figures = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:,.0f}"}
        if rec.get("tflops") is not None:
            figures["TFLOP/s"] = f"{rec['tflops']:.3g}"
        if rec.get("mfu") is not None:
            figures["mfu"] = f"{100 * rec['mfu']:.1f}%"
        if rec.get("peak_mem_bytes") is not None:
            figures["mem"] = f"{rec['peak_mem_bytes'] / 2**30:.2f}G"
        if rec.get("expert_imbalance") is not None:  # the worst expert layer's max/mean tokens per expert
            figures["experts"] = f"{rec['expert_imbalance']:.2f}x"
        if rec.get("val_loss") is not None:
            figures["val"] = f"{rec['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix(figures, refresh=True)
            return
        text = " ".join(f"{k} {v}" for k, v in figures.items())
        print(f"[raytp] step {done}/{self.total} {text} eta {_eta(rec['step_time_s'] * (self.total - done))}",
              file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
