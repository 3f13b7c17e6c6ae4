"""What parallelize reads from a model's structure, single-process: where modules run relative
to the stack (torchpp.models.run_order), per-layer head counts of heterogeneous configs, the
placeholders of modules held elsewhere, and plan="auto" (torchpp.models.auto_plan)."""
import pytest
import torch

from torchpp.models.auto_plan import auto_plans, find_stack
from torchpp.models.passes.resolve import layer_contexts
from torchpp.models.plans import hf_layout, hf_tp_plan
from torchpp.models.run_order import traced_layout
from torchpp.models.placeholders import Elsewhere
from torchpp.tensor_parallel.styles import PlanError, TPContext
from torchpp.testing.tiny_models import tiny_model


def layout_of(model_type):
    model = tiny_model(model_type)
    return traced_layout(model, hf_layout(model))


def test_module_registered_after_the_stack_but_run_before_goes_first():
    layout = layout_of("phi4_multimodal")  # embed_tokens_extend: registered after the layers
    assert "model.embed_tokens_extend" in layout.before and "model.embed_tokens_extend" not in layout.after


def test_module_registered_before_the_stack_but_run_after_goes_last():
    layout = layout_of("t5_gemma_module")  # the encoder's final norm is registered before its layers
    assert (layout.before, layout.after) == (["embed_tokens"], ["norm"])


def test_modules_feeding_every_layer_are_shared():
    assert layout_of("mistral_large4_text").shared == ["rotary_emb"]  # a learned rotary scale
    gemma4 = layout_of("gemma4_text")  # per-layer token embeddings, and what they are computed from
    assert {"model.embed_tokens_per_layer", "model.per_layer_model_projection"} <= set(gemma4.shared)
    assert "lm_head" in gemma4.after  # tied to a shared embedding, still run last
    assert layout_of("llama").shared == []


def test_heterogeneous_layers_get_their_own_head_counts():
    model = tiny_model("gemma4_text")
    config = model.config.get_text_config()
    contexts = layer_contexts(model, TPContext(None, num_heads=4, num_kv_heads=2, head_dim=16), "model.layers")
    assert contexts, "gemma4_text's global layers have their own head_dim"
    for path, ctx in contexts.items():
        layer = config.per_layer_config[int(path.rsplit(".", 1)[1])]
        assert ctx.head_dim == layer.head_dim and ctx.num_kv_heads == layer.num_key_value_heads


def test_elsewhere_returns_zeros_of_the_modules_output_shape():
    embedding = torch.nn.Embedding(11, 6)
    placeholder = Elsewhere("embed", True, embedding)
    out = placeholder(torch.zeros(2, 5, dtype=torch.long))
    assert out.shape == (2, 5, 6) and not out.any()
    assert not list(placeholder.parameters())  # the shape copy is on the meta device, not registered


@pytest.mark.parametrize("model_type, gathered, kept", [
    ("esmc", "layers.0.self_attn", "layers.0.mlp"),  # q/k LayerNorms over every head at once
    ("gemma3n_text", "model.layers.0.mlp", "model.layers.3.mlp"),  # sparse activations' mean and spread
])
def test_statistics_across_a_split_width_gather_that_group(model_type, gathered, kept):
    from torchpp.models.split_checks import gather_where_width_statistics
    from torchpp.tensor_parallel.plan import resolve_plan

    model = tiny_model(model_type)
    resolved = resolve_plan(model, hf_tp_plan(model)[0], False)
    plan = gather_where_width_statistics(model, resolved)
    assert {s for n, s in plan.items() if n.startswith(gathered + ".")} == {"colwise_gather_output",
                                                                             "rowwise_split_input"}
    assert {s for n, s in plan.items() if n.startswith(kept + ".")} == {"colwise", "rowwise"}
    assert not any(n.startswith(gathered + ".") and s == "replicated_with_grad_allreduce" for n, s in plan.items())



def test_a_slice_over_a_lone_key_value_head_is_not_a_statistic():
    """Rotary slices each head's features in halves; with one key/value head k_proj's whole
    width is that head, and the slice must not read as a reduction (it once gathered k/v
    instead of copying the head, so a checkpoint's shards no longer matched)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from torchpp.models.split_checks import gather_where_width_statistics
    from torchpp.tensor_parallel.plan import resolve_plan

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1))
    resolved = resolve_plan(model, hf_tp_plan(model)[0], False)
    plan = gather_where_width_statistics(model, resolved)
    assert plan == resolved, {n: (resolved.get(n), s) for n, s in plan.items() if resolved.get(n) != s}

def test_auto_plan_splits_readers_and_writers():
    plan, layout = auto_plans(tiny_model("biogpt"))
    assert layout.layers == find_stack(tiny_model("biogpt")) == "biogpt.layers"
    assert plan == {"biogpt.layers.*.self_attn.q_proj": "colwise", "biogpt.layers.*.self_attn.k_proj": "colwise",
                    "biogpt.layers.*.self_attn.v_proj": "colwise", "biogpt.layers.*.self_attn.out_proj": "rowwise",
                    "biogpt.layers.*.fc1": "colwise", "biogpt.layers.*.fc2": "rowwise"}


def test_auto_plan_norms_between_the_split_linears():
    per_head, _ = auto_plans(tiny_model("persimmon"))  # q/k layernorms over each head
    assert per_head["model.layers.*.self_attn.q_layernorm"] == "replicated_with_grad_allreduce"
    assert per_head["model.layers.*.self_attn.dense"] == "rowwise"
    whole, _ = auto_plans(tiny_model("olmoe"))  # q/k norms over every head at once
    assert whole["model.layers.*.self_attn.q_proj"] == "colwise_gather_output"
    assert whole["model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    assert "model.layers.*.self_attn.q_norm" not in whole


class _ToyLayer(torch.nn.Module):
    """Branches on the residual stream: a -> b -> c where c reads a too (Mamba's in_proj -> x_proj ->
    out_proj); an MLP (up -> down); a low-rank projection lo_a widened by lo_b, then lo_c (MLA's q_a -> q_b -> o); r
    feeding the writer w while m, feeding u, reads r's output too (r's second writer: its output is
    whole again after the all-reduce); and q -> o reading the stream scaled by a mix that
    mix_down -> mix_up computes (a hyper-connection)."""

    def __init__(self, width=8, mixer_only=False):
        super().__init__()
        self.mixer_only = mixer_only
        self.a, self.b, self.c = (torch.nn.Linear(width, width) for _ in range(3))
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.lo_a, self.lo_b, self.lo_c = torch.nn.Linear(width, 2), torch.nn.Linear(2, width), torch.nn.Linear(width, width)
        self.r, self.w, self.m, self.u = (torch.nn.Linear(width, width) for _ in range(4))
        self.mix_down, self.mix_up = torch.nn.Linear(width, 2), torch.nn.Linear(2, width)
        self.q, self.o = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        inner = torch.relu(self.a(x))
        x = x + self.c(inner * torch.sigmoid(self.b(inner)))
        if self.mixer_only:
            return x
        x = x + self.down(torch.relu(self.up(x)))
        x = x + self.lo_c(torch.relu(self.lo_b(self.lo_a(x))))
        hidden = torch.tanh(self.r(x))
        x = x + self.w(hidden) + self.u(torch.relu(self.m(hidden)))
        return x + self.o(torch.relu(self.q(x * torch.sigmoid(self.mix_up(torch.relu(self.mix_down(x)))))))


class _ToyModel(torch.nn.Module):
    def __init__(self, mixer_only=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList(_ToyLayer(mixer_only=mixer_only) for _ in range(2))

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_auto_plan_keeps_whole_what_depends_on_a_linear_between_others(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="torchpp"):
        plan, _ = auto_plans(_ToyModel())
    # The independent MLP splits; so does q -> o: q reads the stream, scaled by what linears kept whole
    # (mix_down -> mix_up) compute whole on every rank. r feeds two writers: w (into the stream) and m,
    # whose output (whole after its all-reduce) only u reads. lo_a's narrow output is whole, so lo_b,
    # which widens it, reads a whole tensor: it splits by columns for lo_c (MLA's q_b for o_proj).
    assert plan == {"layers.*.up": "colwise", "layers.*.down": "rowwise", "layers.*.q": "colwise",
                    "layers.*.o": "rowwise", "layers.*.r": "colwise", "layers.*.w": "rowwise", "layers.*.m": "rowwise",
                    "layers.*.lo_b": "colwise", "layers.*.lo_c": "rowwise"}
    whole = dict(line.strip().split(": kept whole ", 1) for line in caplog.text.splitlines() if ": kept whole " in line)
    assert whole == {
        "layers.*.b": "(with its readers a: c also reads its reader a's output)",  # split, c would see a's shard
        "layers.*.c": "(writes back into the residual stream itself (no linear after it to split by rows))",
        "layers.*.lo_a": "(a low-rank projection (2 features, the stream 8) that lo_b widens back up: computed whole "
                         "on every rank)",
        "layers.*.u": "(writes back into the residual stream itself (no linear after it to split by rows))",
        "layers.*.mix_down": "(a low-rank projection (2 features, the stream 8) that mix_up widens back up: computed "
                             "whole on every rank)",
        "layers.*.mix_up": "(its output mixes into the stream q reads, which needs it whole)",
    }, caplog.text
    assert "linears split per layer: _ToyLayer 9/16" in caplog.text


class _LatentLayer(torch.nn.Module):
    """MLA's shape in small: down's output is a latent that up widens and a part that reaches out's
    input directly, shared by every feature (the rotary key every head shares); with ``extra``, a
    linear outside the group reads the latent too."""

    def __init__(self, extra=False):
        super().__init__()
        self.down, self.up, self.out = torch.nn.Linear(8, 3), torch.nn.Linear(2, 8), torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(3, 8) if extra else None

    def forward(self, x):
        down = self.down(x)
        latent, shared = down.split([2, 1], dim=-1)
        y = x + self.out(torch.tanh(self.up(latent)) * shared)
        return y + self.extra(down) if self.extra is not None else y


def test_auto_plan_moves_the_f_onto_a_latent_reaching_its_writer_directly():
    model = _ToyModel()
    model.layers = torch.nn.ModuleList(_LatentLayer() for _ in range(2))
    plan, _ = auto_plans(model, tp=2)
    assert plan == {"layers.*.down": "replicated_copy_output", "layers.*.up": "colwise_after_copy",
                    "layers.*.out": "rowwise"}, plan
    # A linear outside the group reading the latent too: one f on down's output would sum its
    # gradient a second time, so the group stays whole.
    model.layers = torch.nn.ModuleList(_LatentLayer(extra=True) for _ in range(2))
    with pytest.raises(PlanError, match=r"layers\.0\.out stays whole: with its readers down, up: down reaches it "
                                        r"directly and also feeds extra, not a reader of its group reading down alone"):
        auto_plans(model, tp=2)


def test_auto_plan_that_splits_nothing_says_why():
    with pytest.raises(PlanError, match=r"nothing in layers splits: layers\.0\.b stays whole: with its readers a: "
                                        r"c also reads its reader a's output"):
        auto_plans(_ToyModel(mixer_only=True))
    # 3 heads and 95 intermediate features, neither of which tp=2 divides: each group's trial fails.
    with pytest.raises(PlanError, match=r"nothing in model\.layers splits over tp=2: model\.layers\.0\.mlp\.down_proj "
                                        r"stays whole: .* mlp\.(gate|up)_proj has 95 output features, which tp=2 does not "
                                        r"divide \(and 7 more kept whole\)"):
        auto_plans(tiny_model("llama", num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=48,
                              intermediate_size=95), tp=2)


def test_auto_plan_refuses_layers_run_without_autograd():
    # Reformer's reversible layers run inside a custom autograd function: no graph to read. (The
    # trace runs at all because it takes the 16 tokens Reformer's axial positions factor.)
    with pytest.raises(PlanError, match=r"4 layers of reformer\.encoder\.layers \(the first: "
                                        r"reformer\.encoder\.layers\.0\) run without autograd.*pass plan="):
        auto_plans(tiny_model("reformer"), tp=2)


def test_trace_records_what_layers_hand_to_later_layers():
    assert layout_of("glm_moe_dsa").extras  # (hidden, top-k indices) from every layer
    state = layout_of("gemma3n_text").layer_state  # shared key/value states for the last layers
    assert state and all(name == "shared_kv_states" for name, _ in state.values())
    assert not layout_of("llama").extras and not layout_of("llama").layer_state


def test_auto_plan_splits_fused_projections_part_by_part():
    plan, _ = auto_plans(tiny_model("gpt2"))  # transformers' Conv1D; c_attn's output split into q, k, v
    assert plan["transformer.h.*.attn.c_attn"] == "packed3_colwise"
    assert plan["transformer.h.*.attn.c_proj"] == "rowwise" and plan["transformer.h.*.mlp.c_fc"] == "colwise"


def test_loss_convention_is_read_from_the_model():
    from torchpp.models.parallel_causal_lm import model_shifts_labels

    assert model_shifts_labels(tiny_model("llama"))  # token t predicts label t+1
    assert not model_shifts_labels(tiny_model("blenderbot"))  # each token's own label


def test_auto_plan_keeps_whole_the_groups_a_split_would_break():
    # LFM3's short convolution mixes in_proj's output with a depthwise conv over its whole width:
    # split over tp=2 it fails, so the mixer stays whole while its MLP still splits
    # (torchpp.models.auto_check).
    plan, _ = auto_plans(tiny_model("lfm3"), tp=2)
    assert not any(".conv." in name for name in plan), plan
    assert plan["model.layers.*.feed_forward.w2"] == "rowwise"
    assert "model.layers.0.conv.in_proj" in auto_plans(tiny_model("lfm3"))[0]  # tp=1: nothing tried


def test_auto_plan_splits_parts_a_view_cuts_as_fused_parts():
    # Moshi's fc1 output is viewed as (2, -1), gate and up: split plainly the ranks' sums differ.
    plan, _ = auto_plans(tiny_model("moshi"), tp=2)
    assert plan["model.layers.*.mlp.fc1"] == "packed_colwise" and plan["model.layers.*.mlp.fc2"] == "rowwise"


def test_traced_forward_leaves_no_autograd_history_on_modules():
    model = tiny_model("recurrent_gemma")  # its RG-LRU keeps its last recurrent state
    auto_plans(model)
    left = [name for name, module in model.named_modules() for value in vars(module).values()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    assert not left, left


def test_packed_readers_feed_a_row_split():
    from torchpp.models.split_checks import gather_where_width_statistics
    from torchpp.tensor_parallel.plan import resolve_plan

    model = tiny_model("modernbert-decoder")  # mlp.Wi: [input; gate], chunked in two
    plan, _ = auto_plans(model)
    resolved = resolve_plan(model, plan, False)
    assert gather_where_width_statistics(model, resolved)["model.layers.0.mlp.Wo"] == "rowwise"


def two_stages_logits(model_type):
    """(the unwrapped model's logits, stage 1 of 2 run on stage 0's output) under plan="auto", one process."""
    import copy

    from torchpp.models.stages import cut_in_place, get_submodule
    from torchpp.testing.model_checks import batch, float64_throughout

    with float64_throughout():
        model = tiny_model(model_type).eval()
        layout = traced_layout(model, auto_plans(model)[1])
        ids = batch(97, batch_size=1)[0]
        expected = model(input_ids=ids, use_cache=False).logits
        n = len(get_submodule(model, layout.layers))
        first, last = copy.deepcopy(model), copy.deepcopy(model)
        stage0 = cut_in_place(first, layout, [0, n // 2, n], [0], True)[0]
        stage1 = cut_in_place(last, layout, [0, n // 2, n], [1], True)[1]
        return expected, stage1(*stage0(ids))


@pytest.mark.parametrize("model_type", [
    "mvp",  # layers return a 1-tuple the model indexes: the placeholders of earlier layers return one too
    "xlstm",  # layers return (hidden, recurrent state tuple): only tensors travel to the next stage
    "llama4_text",  # the forward reads embed_tokens.weight.device on every stage
    "blt",  # its patcher's integer patch lengths steer the whole forward: it runs on every stage
    "xmod",  # the forward reads layer[0].output.adapter_modules on every stage (a layer held elsewhere)
])
def test_a_later_stage_runs_the_models_forward_as_the_whole_model(model_type):
    expected, got = two_stages_logits(model_type)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_the_stack_is_no_list_inside_a_layer_and_may_mix_layer_classes():
    assert find_stack(tiny_model("zamba2")) == "model.layers"  # Mamba and hybrid layers; not an adapter list


def test_the_stack_runs_on_token_ids():
    assert find_stack(tiny_model("gemma3")) == "model.language_model.layers"  # not the longer vision tower


def test_a_stack_the_model_adds_around_or_loops_over_cannot_be_pipelined():
    from torchpp.models.stack_check import check_layers_chain

    with pytest.raises(PlanError, match=r"transformer.attentions.1 is computed from the input of transformer.attentions.0"):
        check_layers_chain(tiny_model("xlm"), "transformer.attentions")  # parallel lists, residual outside
    with pytest.raises(PlanError, match=r"model.layers.0 runs 2 times in one forward"):
        check_layers_chain(tiny_model("dory"), "model.layers")  # recurrent loops over its layers
    check_layers_chain(tiny_model("llama"), "model.layers")


def test_elsewhere_shows_the_modules_own_tensors_without_memory():
    placeholder = Elsewhere("embed", True, torch.nn.Embedding(11, 6, dtype=torch.float64))
    assert placeholder.weight.shape == (11, 6) and placeholder.weight.dtype == torch.float64
    assert placeholder.weight.stride() == (0, 0) and not list(placeholder.parameters())


def test_auto_plan_reads_head_counts_per_layer_of_a_heterogeneous_config():
    # dots3_note's config holds its head counts per layer and refuses a model-wide read: the rule
    # reads each layer's own. Its MLA splits as Megatron's does: the down projections q_a and kv_a
    # whole, q_b and kv_b by columns, o by rows; kv_a's rotary key reaches the heads directly, so
    # the f moves onto kv_a's output and kv_b has none (its norm's gradients summed over TP).
    plan, _ = auto_plans(tiny_model("dots3_note"), tp=2)
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise" and plan["model.layers.1.mlp.shared_experts.up_proj"]
    attention = {name.rpartition(".")[2]: style for name, style in plan.items() if ".self_attn." in name}
    assert attention == {"q_b_proj": "colwise", "kv_b_proj": "colwise_after_copy", "o_proj": "rowwise",
                         "kv_a_proj_with_mqa": "replicated_copy_output", "g_proj": "colwise",
                         "kv_a_layernorm": "replicated_with_grad_allreduce",
                         "k_rope_only_layernorm": "replicated_with_grad_allreduce"}, plan
