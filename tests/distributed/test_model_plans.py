"""parallelize by plan, in place: transformers families that torchpp has no code for (their own
tp/pp plans) at tp=2 and at pp=2 under zb-h1, a user's nn.Module with a plan dict (tp, and pp
with any schedule), and the plan errors every rank raises alike. All against the unwrapped
model in float64 (torchpp.testing.model_checks): loss, output, every gradient, one SGD step."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchpp
from torchpp.models import parallelize
from torchpp.tensor_parallel.styles import PlanError
from torchpp.testing.model_checks import assert_close, check_pp, check_tp

TIMEOUT_S = 300
# Families with no torchpp code: each runs on its own tp/pp plans from transformers.
FAMILIES = ("olmo2", "granite", "starcoder2", "cohere", "smollm3", "glm4", "exaone4", "phi", "gpt_neox",
            "qwen3_moe", "deepseek_v3", "ernie4_5")


def check_families(mode):
    done = {}
    for model_type in FAMILIES:
        done[model_type] = check_tp(model_type) if mode == "tp" else check_pp(model_type, schedule="zb-h1")
    return done


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_transformers_families_by_their_own_plans(ranks, mode):
    results = ranks(2).run(check_families, mode, timeout=TIMEOUT_S)
    assert all(set(r) == set(FAMILIES) for r in results), results


class Block(nn.Module):
    """A user's pre-norm transformer block: heads come from the projection's width (as in
    transformers), so column-sharded q/k/v hold this rank's heads."""

    def __init__(self, dim, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.out(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class UserLM(nn.Module):
    def __init__(self, vocab=37, dim=16, head_dim=4, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, head_dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


USER_TP_PLAN = {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise",
                "layers.*.out": "rowwise", "layers.*.up": "colwise", "layers.*.down": "rowwise"}
USER_PP_PLAN = ["embed", "layers", "norm", "head"]


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _user_case():
    torch.manual_seed(0)
    model = UserLM().double()
    ids = torch.randint(0, 37, (4, 8))
    target = torch.randint(0, 37, (4, 8))
    reference = copy.deepcopy(model)
    ref_logits = reference(ids)
    ref_loss = lm_loss(ref_logits, target)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    return model, ids, target, ref_logits.detach(), ref_loss.detach(), ref_grads


def _compare(wrapped, ref_grads, what):
    grads = wrapped.full_state_dict(grads=True)
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], f"{what} grad of {name}")
    return set(grads)


def check_user_tp():
    state = torchpp.init_parallel(tp=2, pp=1)
    model, ids, target, ref_logits, ref_loss, ref_grads = _user_case()
    wrapped = parallelize(model, plan=USER_TP_PLAN, state=state)
    assert wrapped is model and isinstance(wrapped, UserLM)
    assert wrapped.layers[0].q.weight.shape == (8, 16), "colwise shards q in place"
    logits = wrapped(ids)  # the user's own forward and calling convention
    assert_close(logits, ref_logits, "user model tp=2 logits")
    loss = lm_loss(logits, target)
    assert_close(loss, ref_loss, "user model tp=2 loss")
    loss.backward()
    names = _compare(wrapped, ref_grads, "user model tp=2")
    assert names == set(ref_grads), set(ref_grads) ^ names
    return True


def check_user_pp(schedule, tp):
    state = torchpp.init_parallel(tp=tp, pp=2)
    model, ids, target, _, ref_loss, ref_grads = _user_case()
    plan = {"tp": USER_TP_PLAN if tp > 1 else {}, "pp": USER_PP_PLAN}
    wrapped = parallelize(model, plan=plan, schedule=schedule, n_microbatches=4, state=state, loss_fn=lm_loss)
    loss = wrapped.step(ids if wrapped.has_first_stage else None, target=target if wrapped.has_last_stage else None)
    if wrapped.has_last_stage:
        assert_close(loss, ref_loss, f"user model pp=2 tp={tp} {schedule} loss")
    # Zero-bubble schedules put the linears the plan leaves plain on the split B/W op (W has work).
    held = {id(m): m for st in wrapped.schedule.stages for m in st.submod.modules() if isinstance(m, nn.Linear)}
    plain = [m for m in held.values() if getattr(m.weight, "tp_layout", None) is None]
    swapped = [m for m in held.values() if hasattr(type(m), "_torchpp_plain_class")]
    # tp=1: every linear is plain; tp=2: the plan shards all but the head.
    assert len(plain) == (len(held) if tp == 1 else int(wrapped.has_last_stage)), (len(plain), len(held))
    if schedule in ("zb-h1", "zb-v"):
        assert swapped == plain, (schedule, tp, len(swapped), len(plain))
    else:
        assert not swapped, (schedule, tp, len(swapped))
    return sorted(_compare(wrapped, ref_grads, f"user model pp=2 tp={tp} {schedule}"))


def test_user_module_with_tp_plan(ranks):
    assert ranks(2).run(check_user_tp, timeout=120) == [True, True]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_user_module_with_pp_plan(ranks, schedule):
    per_rank = ranks(2).run(check_user_pp, schedule, 1, timeout=120)
    covered = set().union(*map(set, per_rank))
    assert covered == {n for n, _ in UserLM().named_parameters()}, "the stages hold every parameter"


def test_user_module_with_pp_and_tp_plan(ranks):
    per_rank = ranks(4).run(check_user_pp, "zb-h1", 2, timeout=180)
    assert set().union(*map(set, per_rank)) == {n for n, _ in UserLM().named_parameters()}


def check_plan_errors():
    state = torchpp.init_parallel(tp=2, pp=1)
    messages = []
    for plan in ({"layers.*.q": "diagonal"}, {"layers.*.query": "colwise"}, {"tp": {}, "pp": ["embed", "blocks"]}):
        try:
            parallelize(UserLM(), plan=plan, state=state)
        except (PlanError, AttributeError, ValueError) as error:
            messages.append(str(error))
        else:
            raise AssertionError(f"plan {plan} must raise")
    return messages


def test_plan_errors_name_the_offending_entry_on_every_rank(ranks):
    per_rank = ranks(2).run(check_plan_errors, timeout=60)
    for unknown_style, no_match, bad_stack in per_rank:
        assert "diagonal" in unknown_style and "layers.0.q" in unknown_style, unknown_style
        assert "layers.*.query" in no_match, no_match
        assert "blocks" in bad_stack or "layers" in bad_stack, bad_stack
