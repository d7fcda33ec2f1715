"""The asynchronous update rules (tasks/runtime/async_rule.py) on a real optimizer."""
import pytest
import torch

from tasks.runtime.async_rule import RULES, implicit_momentum, make_rule


def _optimizer(kind: str) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(3))]
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999))
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _momentum(optimizer) -> float:
    group = optimizer.param_groups[0]
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_worker_trains_as_configured(name, kind):
    """Staleness 0 (one worker): the configured learning rate and momentum, whatever the rule."""
    optimizer = _optimizer(kind)
    rule = make_rule(name, optimizer)
    for _ in range(50):
        assert rule.prepare(0.1, 0) == pytest.approx(0.1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert _momentum(optimizer) == pytest.approx(0.9)


@pytest.mark.parametrize("name, power", [("sqrt", 0.5), ("inverse", 1.0), ("momentum", 0.0), ("guarded", 0.0)])
def test_learning_rate_is_damped_by_staleness(name, power):
    rule = make_rule(name, _optimizer("sgd"))
    assert rule.prepare(0.1, 3) == pytest.approx(0.1 / 4 ** power)
    assert make_rule(name, _optimizer("sgd"), lr_power=0.5).prepare(0.1, 3) == pytest.approx(0.05)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_momentum_rule_keeps_the_total_momentum_of_n_workers(kind):
    """Five workers (staleness about 4): implicit momentum 0.8, so 0.9 explicit becomes 0.5
    ((1 - 0.5) (1 - 0.8) = 1 - 0.9); the other rules leave it at 0.9."""
    optimizer = _optimizer(kind)
    rule = make_rule("momentum", optimizer)
    for _ in range(300):
        rule.prepare(0.1, 4)
    assert implicit_momentum(4) == pytest.approx(0.8)
    assert _momentum(optimizer) == pytest.approx(0.5, abs=1e-3)
    for _ in range(300):  # the cluster shrinks to one worker: the momentum comes back
        rule.prepare(0.1, 0)
    assert _momentum(optimizer) == pytest.approx(0.9, abs=1e-3)
    other = _optimizer(kind)
    sqrt = make_rule("sqrt", other)
    for _ in range(300):
        sqrt.prepare(0.1, 4)
    assert _momentum(other) == pytest.approx(0.9)


def test_configured_momentum_is_read_before_a_checkpoint_lowers_it():
    """A resumed PS loads an optimizer state whose momentum the rule had lowered; the rule keeps
    lowering from the configured value, not from the lowered one."""
    optimizer = _optimizer("sgd")
    rule = make_rule("momentum", optimizer)
    for _ in range(300):
        rule.prepare(0.1, 4)
    state = optimizer.state_dict()
    resumed = _optimizer("sgd")
    again = make_rule("momentum", resumed)
    resumed.load_state_dict(state)
    again.prepare(0.1, 0)
    assert _momentum(resumed) == pytest.approx(0.9)


def test_unknown_rule_names_the_known_ones():
    with pytest.raises(ValueError, match="known: guarded, momentum, sqrt, inverse"):
        make_rule("nesterov", _optimizer("sgd"))


def _five_workers(rule, losses):
    """Updates at staleness 4 (five workers), each reporting the next loss; the last lr."""
    lr = None
    for loss in losses:
        rule.observe(loss)
        lr = rule.prepare(0.1, 4)
    return lr


def test_guarded_rule_gives_sgd_back_its_step_while_the_loss_falls():
    """Momentum 0.9 lowered to 0.5 on five workers shrinks SGD's step on slow directions,
    lr / (1 - mu), five times; while the loss falls the raise grows back to that factor."""
    optimizer = _optimizer("sgd")
    rule = make_rule("guarded", optimizer)
    assert _five_workers(rule, [1.0] * 20) < 0.15  # no raise before the staleness is known
    lr = _five_workers(rule, [1.0 - i / 1000 for i in range(400)])
    assert _momentum(optimizer) == pytest.approx(0.5, abs=1e-3)
    assert lr == pytest.approx(0.1 * 0.5 / 0.1, rel=1e-2) == optimizer.param_groups[0]["lr"]


def test_guarded_rule_halves_the_raise_for_good_when_the_loss_rises():
    optimizer = _optimizer("sgd")
    rule = make_rule("guarded", optimizer)
    top = _five_workers(rule, [1.0] * 400)
    rising = _five_workers(rule, [1.0 + i / 10 for i in range(1, 30)])
    assert rising <= top / 2
    after = _five_workers(rule, [0.5] * 400)  # falling and flat again: it regrows, to the cap only
    assert rising <= after <= top / 2 + 1e-9
    _five_workers(rule, [float("nan")] * 30)  # a NaN loss is a rise: back to the momentum rule's lr
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_guarded_rule_leaves_adams_step_alone():
    """Adam's step does not grow with beta1: the rule is `momentum` there."""
    optimizer = _optimizer("adam")
    assert _five_workers(make_rule("guarded", optimizer), [1.0 - i / 1000 for i in range(400)]) == pytest.approx(0.1)
    assert _momentum(optimizer) == pytest.approx(0.5, abs=1e-3)
