"""The data stream in a checkpoint: one ``data.slot<k>of<K>`` item per micro-batch slot; a checkpoint of another
global batch (another K) is refused with one line and is not taken for a damaged one (no fallback)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_mm.train.checkpoint import CheckpointManager, DataLayoutError
from titan_mm.train.state import TrainState
from titan_mm.train.synthetic import SyntheticLoader


def make_state(n_micro: int) -> TrainState:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = SyntheticLoader(vocab_size=64, seq_len=16, micro_batch_size=2, n_micro=n_micro)
    return TrainState(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      dataloader=loader)


def test_slots_saved_and_other_global_batch_refused(tmp_path, capsys):
    st = make_state(2)
    it = iter(st.dataloader)
    for _ in range(6):  # 3 steps of 2 micro-batches
        next(it)
    for step in (2, 3):
        st.step = step
        CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(st)
    keys = set(dcp.FileSystemReader(str(tmp_path / "step-00000003")).read_metadata().state_dict_metadata)
    assert {k for k in keys if k.startswith("data.")} == {"data.slot0of2.blob", "data.slot1of2.blob"}

    same = make_state(2)
    assert CheckpointManager(tmp_path, interval=1).resume(same) == 3
    assert same.dataloader.served == 6

    other = make_state(1)  # global batch of 1 micro-batch instead of 2
    with pytest.raises(DataLayoutError, match="data stream has 2 micro-batch slots per global batch, this run has 1 "):
        CheckpointManager(tmp_path, interval=1).resume(other)
    assert "falling back" not in capsys.readouterr().err  # step 2 has the same layout: no fallback to it
