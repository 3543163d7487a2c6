"""One process of the Trainer-on-several-processes test (tests/test_integrations_hf.py), run
as ``torchrun`` runs it: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the
environment, so that the Trainer (accelerate) starts a gloo process group and trains with DDP.

Usage: python hf_worker.py STORE OUT MAX_STEPS [STOP_AFTER|-] [resume]
Trains the tiny GPT-2 of the tests with a GradlogTrainer (gradient accumulation 2) for
MAX_STEPS steps (or stops after STOP_AFTER steps, an interrupted run), saving a checkpoint at
every step; rank 0 keeps the parameters at the start of each optimizer step in
``OUT/params-S.npz`` (numpy, no pickle). With ``resume`` it resumes from the last checkpoint
in OUT.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

N_DATA, T, VOCAB = 12, 10, 40


def make_model(seed: int = 0) -> Any:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).double()


def make_data() -> list[dict[str, torch.Tensor]]:
    """Token ids with ragged labels: a prompt without loss of 0..4 tokens."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N_DATA, T), generator=gen)
    items = []
    for i in range(N_DATA):
        labels = ids[i].clone()
        labels[: i % 5] = -100
        items.append({"input_ids": ids[i], "labels": labels})
    return items


def main() -> None:
    import transformers

    from gradlog.integrations.transformers import GradlogCallback, GradlogTrainer, IndexedDataset

    store, out, max_steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    stop_after = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    resume = sys.argv[5:6] == ["resume"]
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)

    class Snapshots(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                params = {k.replace(".", "/"): v.detach().numpy()
                          for k, v in kwargs["model"].state_dict().items()}
                np.savez(out / f"params-{state.global_step}.npz", **params)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True
            return control

    out.mkdir(parents=True, exist_ok=True)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=3, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=0.05, lr_scheduler_type="linear", optim="sgd",
        report_to=[], use_cpu=True, ddp_backend="gloo", save_strategy="steps", save_steps=1,
        logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
    )
    trainer = GradlogTrainer(
        model=make_model(), args=args, train_dataset=IndexedDataset(make_data()),
        callbacks=[GradlogCallback(store, check_every=1, dtype="float64"), Snapshots()],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)


if __name__ == "__main__":
    main()
