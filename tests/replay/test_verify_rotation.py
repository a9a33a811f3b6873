"""The vote of replay/verify/rotation.py on hand-made shard fingerprints (no devices needed): a
replicated leaf held by every device, a sharded leaf whose shard p is computed by device p + r in
rotation r, and a single-device leaf moving with the rotation."""

from __future__ import annotations

from replay.verify.classify import classify
from replay.verify.rotation import devices_used, step_events

N = 4


def executions(bad: int | None = None, flip=lambda fp: fp ^ 1) -> dict[int, dict]:
    out = {}
    for r in (0, 1, 2):
        fps = {("params/w", "0:"): [(d, 100) for d in range(N)],  # replicated: every device a copy
               ("loss", ""): [(r % N, 7)]}  # a single-device leaf on device r
        for p in range(N):  # sharded over the mesh: position p on device (p + r) % N
            fps[("acts", f"{p}:{p + 1}")] = [((p + r) % N, 1000 + p)]
        out[r] = {k: [(d, flip(fp) if d == bad else fp) for d, fp in v] for k, v in fps.items()}
    return out


def test_healthy_devices_agree():
    events, unresolved, names = step_events(3, executions())
    assert events == [] and unresolved == [] and len(names) == 6
    assert devices_used(executions()) == N


def test_a_bad_chip_is_out_voted_on_every_shard_it_computes_and_named():
    events, unresolved, names = step_events(3, executions(bad=2))
    assert {e.device for e in events} == {2} and unresolved == []
    wrong = {names[e.layers[0]] for e in events}
    # device 2 holds a copy of the replicated leaf, computes acts shards 2, 1, 0 in rotations 0, 1, 2
    # and the single-device loss in rotation 2
    assert wrong == {"params/w[0:]", "acts[0:1]", "acts[1:2]", "acts[2:3]", "loss[]"}, wrong
    (finding,) = classify(events, names)
    assert (finding.kind, finding.device, finding.steps) == ("persistent", 2, [3])


def test_two_values_with_as_many_devices_each_are_unresolved_not_clean():
    ex = executions()
    ex[1][("loss", "")] = [(1, 8)]  # loss: 7 on device 0, 8 on device 1, 7 on device 2: device 1 out-voted
    events, unresolved, _ = step_events(0, ex)
    assert [e.device for e in events] == [1] and unresolved == []
    ex[2][("loss", "")] = [(2, 9)]  # three devices, three values: no majority
    events, unresolved, names = step_events(0, ex)
    assert events == [] and [names[i] for i in unresolved] == ["loss[]"]
