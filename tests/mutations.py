"""Planted bugs: plausible one-line changes to jaxpipe, each of which a named test must catch (issue #43, item
4).

    python tests/mutations.py                 # every mutation (about 20 minutes on 2 cores)
    python tests/mutations.py drain_index     # the ones named
    python tests/mutations.py --list

Each mutation is applied to a temporary copy of the repository (never to this tree), and its test is run
there; the runner reports the mutations the suite *missed* (their test passed) and exits 1 if there is one.
A mutation whose text is no longer in the file is reported as stale (the code moved: update the list).
``tests/test_mutations.py`` runs a sample in CI.  Add a mutation for every silent bug a test was written for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mutation(NamedTuple):
    name: str
    path: str  # relative to the repository root
    old: str  # the text replaced (must occur exactly once)
    new: str
    test: str  # the pytest node id that must fail


MUTATIONS = [
    Mutation(
        "second_round_lane_shared",
        "jaxpipe/schedules/lanes.py",
        "    for li in range(after + 1, len(lanes)):\n",
        "    for li in range(max(after, 0), len(lanes)):\n",
        "tests/test_lanes.py::test_plans_are_valid",
    ),
    Mutation(
        "measured_costs_past_the_search_raise",
        "jaxpipe/pipeline.py",
        "            self._build_schedule(self._user_options)  # past the search's size: the unit-time order\n",
        "            raise\n",
        "tests/test_running_costs.py::test_costs_past_the_tick_search_rank_the_plans_and_keep_the_unit_time_order",
    ),
    # issue #43's survivors
    Mutation(
        "w_lane_only_beside_b",
        "jaxpipe/runtime/ticks.py",
        "        if not run[lane] or lane == prog.lane_f2:  # F2 runs beside the F lane (a pair)\n",
        "        if not run[lane] or lane == prog.lane_f2 or (kind_of(kind) == W and not run[prog.kinds.index('B')]):\n",
        "tests/test_lanes.py::test_ordered_placement_is_exact",
    ),
    Mutation(
        "zb_w_wrong_frontier_slot",
        "jaxpipe/runtime/lanes_backward.py",
        '                    else [read(a, rw[ROUTE["front"]]) for a in carry.front]\n',
        '                    else [read(a, rw[ROUTE["front"]] + 1) for a in carry.front]\n',
        "tests/test_wsplit.py::test_executor_runs_w_from_the_frontier",
    ),
    Mutation(
        "fused_tick_sends_twice_on_a_channel",
        "jaxpipe/schedules/lanes.py",
        "        if ch != SEND_NONE and any(_sends(s, k, dev) == ch for k in mine):\n",
        "        if ch != SEND_NONE and False:\n",
        "tests/test_lanes.py::test_ordered_ticks_are_fused_where_no_message_moves",
    ),
    Mutation(
        "fused_tick_swaps_a_devices_actions",
        "jaxpipe/schedules/lanes.py",
        "        li = _lane_after(lanes, a.kind, max((group[k] for k in mine), default=-1))\n",
        "        li = _lane_after(lanes, a.kind, -1)\n",
        "tests/test_lanes.py::test_ordered_ticks_are_fused_where_no_message_moves",
    ),
    Mutation(
        "watchdog_names_only_the_oldest",
        "jaxpipe/cli/launch.py",
        "    return sorted(i for i, a in ages.items() if a > limit / 2), max(ages.values())\n",
        "    return sorted(i for i, a in ages.items() if a > limit), max(ages.values())\n",
        "tests/test_launcher_faults.py::test_the_watchdog_names_the_peers_that_stalled_with_the_stuck_worker",
    ),
    Mutation(
        "zb_w_reads_the_frontier_of_another_stash_slot",
        "jaxpipe/runtime/lanes_backward.py",
        '                    front_pack.get(carry.stash, rw[ROUTE["stash"]], trace.wsp.frontier_avals, '
        "trace.fplace)\n",
        '                    front_pack.get(\n                        carry.stash, rw[ROUTE["stash"]] + 1, '
        "trace.wsp.frontier_avals, trace.fplace\n                    )\n",
        "tests/test_front_pack.py::test_zb_h1_keeps_its_frontier_in_the_stash_exactly_and_in_less_memory",
    ),
    Mutation(
        "zb_frontier_written_over_a_residual_w_reads",
        "jaxpipe/runtime/front_pack.py",
        "    dead = [j for j, a in enumerate(stash_avals) if j not in set(w_reads) and _size(a.shape)]\n",
        "    dead = [j for j, a in enumerate(stash_avals) if _size(a.shape)]\n",
        "tests/test_front_pack.py::test_zb_h1_keeps_its_frontier_in_the_stash_exactly_and_in_less_memory",
    ),
    Mutation(
        "stage_key_ignores_stage",
        "jaxpipe/model.py",
        "    return jax.random.fold_in(mb_key, stage)\n",
        "    return mb_key\n",
        "tests/test_keys_by_hand.py::test_every_stage_microbatch_and_step_has_its_own_key",
    ),
    Mutation(
        "avgpipe_default_alpha",
        "jaxpipe/optim/elastic.py",
        "    return 1.0 / num_pipes\n",
        "    return 1.0 / max(num_pipes - 1, 1)\n",
        "tests/test_avgpipe.py::test_matches_serial_reference",
    ),
    Mutation(
        "drain_index",
        "jaxpipe/runners/no_flush.py",
        "    state = state._replace(counters=(jnp.zeros_like(t), base + fed, jnp.zeros_like(fed)))\n",
        "    state = state._replace(counters=(jnp.zeros_like(t), base, jnp.zeros_like(fed)))\n",
        "tests/test_drain_sequences.py::test_step_step_drain_twice_equals_the_reference",
    ),
    # issue #43's caught bugs, kept caught
    Mutation(
        "pipedream_backward_reads_newest",
        "jaxpipe/optim/policies.py",
        "        return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i % D, 0, False), stash)\n",
        "        return lp\n",
        "tests/test_independent_references.py::test_no_flush_method_equals_its_hand_written_version_table[2-pipedream]",
    ),
    Mutation(
        "2bw_versions_swapped",
        "jaxpipe/optim/policies.py",
        "        return jnp.where(self.latest(ps, i, s), 0, 1), (lp, ps.shadow)\n",
        "        return jnp.where(self.latest(ps, i, s), 0, 1), (ps.shadow, lp)\n",
        "tests/test_independent_references.py::test_no_flush_method_equals_its_hand_written_version_table[2-pipedream_2bw]",
    ),
    Mutation(
        "cdp_v2_rule_reversed",
        "jaxpipe/optim/policies.py",
        "        return jnp.where(i % self.M + s >= self.D - 1, b, b - 1) if self.fresh else b - 1\n",
        "        return jnp.where(i % self.M + s >= self.D - 1, b - 1, b) if self.fresh else b - 1\n",
        "tests/test_independent_references.py::test_no_flush_method_equals_its_hand_written_version_table[2-cdp_v2]",
    ),
    Mutation(
        "pipeoptim_distance_off_by_one",
        "jaxpipe/optim/policies.py",
        '    return (lambda s: D - s) if distance == "code" else (lambda s: D - 1 - s)\n',
        '    return (lambda s: D - s) if distance == "code" else (lambda s: D - s)\n',
        "tests/test_independent_references.py::test_predicting_method_equals_the_hand_written_backward[pipeoptim-4]",
    ),
    Mutation(
        "avgpipe_elastic_sign",
        "jaxpipe/optim/elastic.py",
        "            lambda w, r, uu: (a * "
        "(r[None].astype(w.dtype) - w) + "
        "uu).astype(w.dtype), params, state.ref, u\n",
        "            lambda w, r, uu: (a * (w - r[None].astype(w.dtype)) + uu).astype(w.dtype), params, "
        "state.ref, u\n",
        "tests/test_avgpipe.py::test_reference_is_the_mean_of_the_replicas_and_alpha_matters",
    ),
    Mutation(
        "restore_loses_the_step",
        "jaxpipe/checkpoint.py",
        '        return self._read(step, meta, abstract), meta.get("extra", {}), int(meta["step"])\n',
        "        return (\n  "
        "          (lambda "
        's: s._replace(step=s.step * 0))(self._read(step, meta, abstract)),\n            meta.get("extra", '
        '{}),\n            int(meta["step"]),\n        )\n',
        "tests/test_resume_with_dropout.py::test_resume_restores_the_step_and_the_keys[1f1b]",
    ),
    Mutation(
        "restore_loses_the_optimizer_state",
        "jaxpipe/checkpoint.py",
        '        return self._read(step, meta, abstract), meta.get("extra", {}), int(meta["step"])\n',
        "        return (\n            self._read(step, meta, "
        'abstract)._replace(opt_state=template.opt_state),\n            meta.get("extra", {}),\n            '
        'int(meta["step"]),\n        )\n',
        "tests/test_checkpoint.py::test_resume_is_bit_equal[1f1b]",
    ),
    # the comparison helper itself
    Mutation(
        "rel_err_blind_to_nan",
        "tests/helpers.py",
        '        for side, v in (("first", x), ("second", y)):\n',
        "        for side, v in ():\n",
        "tests/test_mutations.py::test_rel_err_sees_nan_in_any_leaf",
    ),
    # the on-device checks (issue #39 item 1, #42 item 5)
    Mutation(
        "step_ignores_bad_batch",
        "jaxpipe/runners/sync.py",
        "            applied = ok_in & finite  # never an update from a bad batch or a non-finite gradient\n",
        "            applied = finite  # never an update from a bad batch or a non-finite gradient\n",
        "tests/test_step_checks.py::test_a_bad_device_batch_changes_nothing_and_the_next_call_says_so[1f1b-y]",
    ),
    # issue #50's survivors: an id equal to the table's size; the grad-norm metric of the micro-batch sums
    Mutation(
        "id_check_off_by_one",
        "jaxpipe/checks/on_device.py",
        "                bad = (v < 0) if f.bound is None else (v < 0) | (v >= f.bound)\n",
        "                bad = (v < 0) if f.bound is None else (v < 0) | (v > f.bound)\n",
        "tests/test_step_checks.py::test_an_id_out_of_range_on_the_device_is_named_at_the_next_call",
    ),
    Mutation(
        "grad_norm_of_the_sums",
        "jaxpipe/runners/sync.py",
        "            gnorm = optax.tree.norm(mean(sums))\n",
        "            gnorm = optax.tree.norm(sums)\n",
        "tests/test_step_checks.py::test_the_grad_norm_metric_is_the_norm_of_the_steps_mean_gradient",
    ),
    Mutation(
        "select_gate_keeps_the_update",
        "jaxpipe/checks/on_device.py",
        "        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, tuple(operands))\n",
        "        return jax.tree.map(lambda n, o: jnp.where(ok | True, n, o), new, tuple(operands))\n",
        "tests/test_model_axes.py::test_a_bad_device_batch_changes_nothing_on_a_model_axes_mesh",
    ),
    Mutation(
        "cut_search_keeps_the_worse",
        "jaxpipe/cuts/balanced.py",
        "    return min((_descend(schedule, s, "
        "costs, least, plan) for s in starts), "
        "key=lambda ct: (ct[1], ct[0]))\n",
        "    return max((_descend(schedule, s, costs, least, plan) for s in starts), key=lambda ct: (ct[1], "
        "ct[0]))\n",
        "tests/test_cut_costs.py::test_the_search_keeps_the_better_of_its_two_descents",
    ),
    Mutation(
        "zb_embedding_w_on_the_last_stage",
        "jaxpipe/cuts/balanced.py",
        "    w[0] += c.b_pre\n",
        "    w[-1] += c.b_pre\n",
        "tests/test_cut_costs.py::test_stage_costs_by_hand",
    ),
    Mutation(
        "status_never_read",
        "jaxpipe/checks/on_device.py",
        "        msg = self.checks.message(call.fields, status, call.where, call.batch_fields)\n",
        "        msg = None and self.checks.message(call.fields, status, call.where, call.batch_fields)\n",
        "tests/test_step_checks.py::test_an_id_out_of_range_on_the_device_is_named_at_the_next_call",
    ),
    # issue #51: the host runs ahead
    Mutation(
        "host_waits_for_every_step",
        "jaxpipe/checks/on_device.py",
        "        while self._queue and "
        "(len(self._queue) >= max(IN_FLIGHT, 1) "
        "or is_ready(self._queue[0].status)):\n",
        "        while self._queue and (len(self._queue) >= 1 or is_ready(self._queue[0].status)):\n",
        "tests/test_host_ahead.py::test_four_steps_back_to_back_wait_for_nothing_until_the_third[1f1b]",
    ),
    Mutation(
        "refusal_not_carried_to_states_derived_before_it_was_read",
        "jaxpipe/checks/on_device.py",
        "                if c.parent is not None and c.parent.refused is not None:\n",
        "                if False:\n",
        "tests/test_host_ahead.py::test_states_derived_before_the_refusal_was_read_are_refused_by_save",
    ),
    # issue #51 item 3: loss_and_grad's division pass after the loop (right numbers, one more gradient pass)
    Mutation(
        "loss_and_grad_divides_after_the_loop",
        "jaxpipe/runners/sync.py",
        '            divide=scale != 1.0 or what == "grad",\n',
        "            divide=scale != 1.0,\n",
        "tests/test_xla_cost.py::test_loss_and_grad_at_one_device_adds_no_pass_over_the_gradient[1f1b]",
    ),
    # issue #52: a user's batches, resumed, start over instead of where the checkpoint left them
    Mutation(
        "own_model_resume_replays_from_the_start",
        "jaxpipe/training/streams.py",
        '        for _ in range(int(state["position"])):\n',
        "        for _ in range(0):\n",
        "tests/test_own_model_in_trainer.py::test_own_model_from_a_config_file_stops_on_sigterm_and_resumes_bit_equal",
    ),
    # issue #52: the library loop keeps its SIGTERM handler after returning to a user's script
    Mutation(
        "trainer_keeps_its_signal_handlers",
        "jaxpipe/training/loop.py",
        "        if restore_signals:\n            self.stop.uninstall()\n",
        "        pass\n",
        "tests/test_trainer_api.py::test_a_sigterm_saves_and_returns_and_the_next_call_resumes_bit_equal",
    ),
    # issue #52 item 3: the balanced cut stops measuring after three rounds even when a round disagrees
    Mutation(
        "cut_measurement_never_adds_rounds",
        "jaxpipe/cuts/part_costs.py",
        "        while _agreement(rounds, choose)[0] < len(rounds) and len(rounds) < MAX_ROUNDS:\n",
        "        while False:\n",
        "tests/test_uneven_cuts.py::test_the_cut_measurement_adds_rounds_while_a_round_disagrees",
    ),
    # issue #49: the cost-aware ZB-H1 ticks forget 1F1B's memory bound (faster, but 2D - 1 in flight)
    Mutation(
        "zb_costed_ignores_the_memory_bound",
        "jaxpipe/schedules/zb_costed.py",
        "        if nf < M and held < cap and (s == 0 or state[s - 1][0] > nf):\n",
        "        if nf < M and (s == 0 or state[s - 1][0] > nf):\n",
        "tests/test_zb_costed.py::test_the_costed_ticks_reach_the_lockstep_optimum_at_1f1b_memory[4-160.0]",
    ),
    # issue #49: ZB's W added into the sums in place -- never in place, or into the wrong layer's slice
    Mutation(
        "w_into_sums_never_in_place",
        "jaxpipe/runtime/wsplit.py",
        "        if all(len(q) == 1 for q in pos) and not any(o in read for o in outs):\n",
        "        if False:\n",
        "tests/test_wsplit.py::test_w_adds_a_scanned_stages_gradient_into_the_sums_layer_by_layer",
    ),
    Mutation(
        "w_into_sums_wrong_layer",
        "jaxpipe/runtime/wsplit.py",
        "        return [add_into_slice(a, l, y, add) for a, y in zip(acc, outs)]\n",
        "        return [add_into_slice(a, 0, y, add) for a, y in zip(acc, outs)]\n",
        "tests/test_wsplit.py::test_zb_h1_with_scanned_stages_matches_jax_grad",
    ),
    Mutation(  # the in-place scatter-add of W's gradient into its slice overwrites the slice instead
        "w_into_slice_overwrites",
        "jaxpipe/runtime/wsplit.py",
        "    return stacked.at[index].add(addend(grad, stacked.dtype), indices_are_sorted=True, "
        "unique_indices=True)\n",
        "    return stacked.at[index].set(addend(grad, stacked.dtype), indices_are_sorted=True, "
        "unique_indices=True)\n",
        "tests/test_wsplit.py::test_zb_h1_with_scanned_stages_matches_jax_grad",
    ),
    # the flushing schedules' B adds into the sums in place -- never, or its stage gradient dropped
    Mutation(
        "summing_b_never_in_place",
        "jaxpipe/runtime/executor.py",
        "    if prog.split or not all(p.add_leaf is not None and p.sums is not None for p in prog.policies):\n",
        "    if True:\n",
        "tests/test_wsplit.py::test_flushing_schedules_add_a_scanned_stages_gradient_in_place[1f1b-2-options0]",
    ),
    Mutation(
        "summing_b_drops_the_stage_gradient",
        "jaxpipe/runtime/lanes_backward.py",
        "                pstate = prog.policies[chunk].sums[1](pstate, sums[0])\n",
        "                pstate = pstate\n",
        "tests/test_wsplit.py::test_flushing_schedules_add_a_scanned_stages_gradient_in_place[gpipe-2-options1]",
    ),
    # issue #53: the memory model forgets the stash; the configuration keeps a candidate over the budget
    Mutation(
        "memory_footprint_ignores_the_stash",
        "jaxpipe/tune/memory.py",
        "    slots = 0 if plan.direct else plan.stash_capacity\n",
        "    slots = 0\n",
        "tests/test_memory_model.py::test_the_state_on_a_device_is_the_compiled_steps_arguments",
    ),
    Mutation(
        "configure_keeps_a_candidate_over_the_budget",
        "jaxpipe/tune/configure.py",
        "        if id(c) in built and not c.dropped and c.memory > budget:\n",
        "        if id(c) in built and not c.dropped and c.memory > 2 * budget:\n",
        "tests/test_configure.py::test_a_budget_the_full_residuals_exceed_chooses_a_recomputing_policy_that_fits_and_trains",
    ),
    # a one-stage plan calibrated on the pipelined line; every schedule kept on one stage
    Mutation(
        "memory_one_stage_in_the_pipelined_family",
        "jaxpipe/tune/memory.py",
        '    policy = "direct" if plan.direct else "all" if r_pol == r_all else "recompute"\n',
        '    policy = "all" if r_pol == r_all else "recompute"\n',
        "tests/test_memory_model.py::test_a_one_stage_plan_is_a_family_of_its_own_whatever_its_policy",
    ),
    Mutation(
        "chunks_stacked_in_the_state",
        "jaxpipe/runners/sync.py",
        "        self._chunks = ctx.schedule.num_model_stages // ctx.schedule.D if self._stored else 1\n",
        "        self._chunks = 1\n",
        "tests/test_chunk_state.py::test_two_chunks_a_device_are_held_apart_and_the_step_never_stacks_them",
    ),
    Mutation(
        "chunk_zero_sums_merged",
        "jaxpipe/runtime/gradient.py",
        "    if c == 0:\n",
        "    if True:\n",
        "tests/test_chunk_state.py::test_two_chunks_a_device_are_held_apart_and_the_step_never_stacks_them",
    ),
    Mutation(
        "chunked_recut_in_device_order",
        "jaxpipe/checkpoint.py",
        '            self._orders(step, meta.get("fingerprint") or {}),\n',
        "            None,\n",
        "tests/test_chunk_state.py::test_a_chunked_checkpoint_restores_onto_another_cut",
    ),
    Mutation(
        "parent_death_counted_each_time",
        "jaxpipe/training/stopping.py",
        '        if getattr(self, "_parent_died", False):\n            return\n',
        "",
        "tests/test_stop_signals.py::test_the_launchers_death_counts_once_however_often_the_kernel_signals_it",
    ),
    Mutation(
        "memory_forgets_the_frontier",
        "jaxpipe/tune/memory.py",
        "    if pipe.schedule.has_w() and not plan.direct:\n",
        "    if False:\n",
        "tests/test_memory_model.py::test_zero_bubbles_own_frontier_slots_are_known_before_compiling",
    ),
    Mutation(
        "configure_program_key_ignores_the_plan",
        "jaxpipe/tune/configure.py",
        "        plan,\n",
        "",
        "tests/test_configure.py::test_gpipe_under_lanes_is_one_program_with_1f1b_and_is_not_timed_twice",
    ),
    Mutation(
        "configure_keeps_every_schedule_on_one_stage",
        "jaxpipe/tune/configure.py",
        "                        elif D == 1 and name != one:\n",
        "                        elif False:\n",
        "tests/test_configure.py::test_on_one_stage_one_schedule_stands_for_the_others",
    ),
    # a family calibrated on one compile without its policy's slope (flat: every other micro-batch size off)
    Mutation(
        "memory_slope_not_shared",
        "jaxpipe/tune/configure.py",
        "            a = "
        "model.lines.get(anchors[kind(fam)], "
        "(0.0, 0.0))[0] if anchors[kind(fam)] "
        "!= fam else 0.0\n",
        "            a = 0.0\n",
        "tests/test_configure.py::test_one_slope_per_residual_policy_one_compile_per_other_family",
    ),
    # every family compiled at one point only (the anchors too: no slope anywhere)
    Mutation(
        "memory_anchor_compiled_once",
        "jaxpipe/tune/configure.py",
        "        pts = [by_work[-1], by_work[0]] if anchors[kind(fam)] == fam else [by_work[-1]]\n",
        "        pts = [by_work[-1]]\n",
        "tests/test_configure.py::test_one_slope_per_residual_policy_one_compile_per_other_family",
    ),
    # the balanced cut's candidate priced as its even twin (never preferred: the cut model's ratio dropped)
    Mutation(
        "configure_cut_step_not_scaled",
        "jaxpipe/cuts/configure.py",
        "        step_s=best.step_s * choice.predicted / max(choice.even_predicted, 1e-30),\n",
        "        step_s=best.step_s * choice.even_predicted / max(choice.even_predicted, 1e-30),\n",
        "tests/test_configure_cut.py::test_a_heavy_head_gets_a_balanced_cut_as_a_candidate_of_its_own",
    ),
    # its memory taken from the even twin instead of compiled (a longer stage holds more)
    Mutation(
        "configure_cut_memory_not_compiled",
        "jaxpipe/cuts/configure.py",
        "    twin.memory = twin.compiled_memory\n",
        "    twin.memory = best.memory\n",
        "tests/test_configure_cut.py::test_a_heavy_head_gets_a_balanced_cut_as_a_candidate_of_its_own",
    ),
    # the model of a cut candidate built with the even cut (the pick's cut never reaches the user)
    Mutation(
        "configure_cut_model_even",
        "jaxpipe/tune/config_bench.py",
        "        if c.cut is None and not "
        '(plain and getattr(self.model(c.model_stages), "param_specs", None)):\n',
        '        if True or not (plain and getattr(self.model(c.model_stages), "param_specs", None)):\n',
        "tests/test_configure_cut.py::test_the_balanced_model_computes_what_the_even_one_does",
    ),
    # the head's cost charged to the first stage (a heavy head then looks free to a pipeline)
    Mutation(
        "head_cost_on_the_first_stage",
        "jaxpipe/tune/lockstep.py",
        "                out[-1, j] += n * self.f_post\n",
        "                out[0, j] += n * self.f_post\n",
        "tests/test_lockstep_model.py::test_a_heavy_head_is_paid_on_the_last_stage_of_every_micro_batch",
    ),
    # a second search measuring again (the cache never read)
    Mutation(
        "configure_cache_never_read",
        "jaxpipe/tune/measure_cache.py",
        "        if k in self._data:\n",
        "        if False:\n",
        "tests/test_configure.py::test_a_second_search_reads_every_measurement_from_the_cache",
    ),
    # a recomputing stage's zero-bubble W priced as if it ran from the frontier (W at the weight products
    # only)
    Mutation(
        "search_thinks_every_w_splits",
        "jaxpipe/runtime/wsplit.py",
        "    return _stage_split(model, w, x, mb)[0] is not None\n",
        "    return True\n",
        "tests/test_configure.py::test_the_search_knows_when_zero_bubble_w_recomputes",
    ),
    # the stage benchmark reporting a split W where the executor recomputes the backward
    Mutation(
        "stage_bench_thinks_w_always_splits",
        "jaxpipe/tune/stage_bench.py",
        "                self.found.append(sp is not None)\n",
        "                self.found.append(True)\n",
        "tests/test_stage_bench.py::test_a_context_model_under_a_recomputing_policy_reports_that_w_recomputes",
    ),
    # issue #53, model axes: a tensor candidate's stash priced with unsharded residuals
    Mutation(
        "tensor_residuals_unsharded",
        "jaxpipe/tune/config_bench.py",
        "                return residual_bytes_on(pipe.model, self.batch, rows, mesh, w_specs, batch_spec)\n",
        "                return residual_bytes(pipe.model, self.batch, rows)\n",
        "tests/test_configure_axes.py::test_a_tensor_candidate_holds_its_shards",
    ),
    # ... its memory line shared with the unsharded candidates' (their slope is not its own)
    Mutation(
        "tensor_family_shared",
        "jaxpipe/tune/config_bench.py",
        "        axes = () if c.model_axes == (1, 1) else c.model_axes\n",
        "        axes = ()\n",
        "tests/test_configure_axes.py::test_a_tensor_candidate_holds_its_shards",
    ),
    # ... its stage timed on one device (no collectives, the whole weights)
    Mutation(
        "tensor_stage_timed_on_one_device",
        "jaxpipe/tune/config_bench.py",
        "            if tuple(axes) != (1, 1):\n",
        "            if False:\n",
        "tests/test_configure_axes.py::test_a_tensor_stage_is_timed_on_its_devices",
    ),
    # a candidate without model axes built with the model's specs (its mesh lacks the axes: not buildable)
    Mutation(
        "plain_candidate_keeps_specs",
        "jaxpipe/tune/config_bench.py",
        "        plain = c.model_axes == (1, 1)\n",
        "        plain = False\n",
        "tests/test_configure_axes.py::test_the_splits_include_tensor_where_the_specs_name_it",
    ),
    # FSDP's batch split forgotten in the rows check
    Mutation(
        "fsdp_rows_not_split",
        "jaxpipe/tune/configure.py",
        "                        if rows % (c.data * f * M):\n",
        "                        if rows % (c.data * M):\n",
        "tests/test_configure_axes.py::test_an_fsdp_split_shards_the_batch_too_and_trains",
    ),
    # an independent round of 36 planted bugs in the trainer, the step checks, configure and the caches: the
    # 11 that survived the suite, and the 2 it caught only weakly
    Mutation(
        "agreed_stop_needs_every_process",
        "jaxpipe/training/loop.py",
        "        if np.any(told):\n",
        "        if np.all(told):\n",
        "tests/test_stop_agreement.py::test_a_stop_seen_by_one_process_of_two_stops_both",
    ),
    Mutation(
        "stop_request_overwrites_the_first_cause",
        "jaxpipe/training/stopping.py",
        "        if self.reason is None:\n            self.reason = reason\n",
        "        self.reason = reason\n",
        "tests/test_stop_agreement.py::test_a_second_request_keeps_the_first_cause",
    ),
    Mutation(
        "kept_back_judged_on_the_inputs_only",
        "jaxpipe/checks/on_device.py",
        "        return self.keeps_state if inputs_failed else self.loss_keeps_state\n",
        "        return self.keeps_state\n",
        "tests/test_step_checks.py::test_a_no_flush_steps_nonfinite_loss_is_not_kept_back_and_its_states_are_refused",
    ),
    Mutation(
        "cutless_block_keys_by_stage",
        "jaxpipe/cuts/layout.py",
        "            b0 = ctx.stage * n if first_block is None else jnp.asarray(first_block)[ctx.stage]\n",
        "            b0 = ctx.stage if first_block is None else jnp.asarray(first_block)[ctx.stage]\n",
        "tests/test_uneven_cuts.py::test_dropout_masks_of_a_model_without_a_cut_do_not_depend_on_the_stage_count",
    ),
    Mutation(
        "state_footprint_counts_the_whole_batch",
        "jaxpipe/tune/memory.py",
        "    on_device = known_state + tree_bytes(batch) // data\n",
        "    on_device = known_state + tree_bytes(batch)\n",
        "tests/test_memory_model.py::test_the_state_on_a_device_is_the_compiled_steps_arguments",
    ),
    Mutation(
        "compiled_total_counts_aliases_twice",
        "jaxpipe/tune/memory.py",
        "    return int(\n        "
        "ma.argument_size_in_bytes\n  "
        "      + ma.temp_size_in_bytes\n        + max(ma.output_size_in_bytes - ma.alias_size_in_bytes, "
        "0)\n    )\n",
        "    return int(ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes)\n",
        "tests/test_memory_model.py::test_the_compiled_total_counts_a_donated_output_once",
    ),
    Mutation(
        "part_backward_includes_the_forward",
        "jaxpipe/cuts/part_costs.py",
        '    back = lambda p: max(r[f"fb_{p}"] - r[f"f_{p}"], MIN_BACKWARD_SHARE * r[f"f_{p}"])\n',
        '    back = lambda p: r[f"fb_{p}"]\n',
        "tests/test_cut_costs.py::test_a_measured_round_becomes_part_costs_by_hand",
    ),
    Mutation(
        "part_backward_never_timed_again",
        "jaxpipe/cuts/part_costs.py",
        "            for _ in range(RETIMES):\n",
        "            for _ in range(0):\n",
        "tests/test_cut_costs.py::test_a_backward_timed_no_longer_than_its_forward_is_timed_again",
    ),
    Mutation(
        "custom_overlap_keeps_only_its_forward",
        "jaxpipe/schedules/custom.py",
        '        return [action for part in overlap.group(1).split(";") for action in _parse(part, device, position)]\n',
        '        return [action for part in overlap.group(1).split(";")[:1] for action in _parse(part, device, position)]\n',
        "tests/test_custom_schedules.py::test_pytorchs_own_order_runs_exactly",
    ),
    Mutation(
        "custom_whole_backward_without_its_weight_half",
        "jaxpipe/schedules/custom.py",
        "                if split:\n                    out.append(Action(W, mb, stage, chunk))\n",
        "                if False:\n                    out.append(Action(W, mb, stage, chunk))\n",
        "tests/test_custom_schedules.py::test_a_whole_backward_in_a_split_schedule_runs_as_its_two_halves",
    ),
    Mutation(
        "custom_order_check_skips_its_own_device",
        "jaxpipe/schedules/custom.py",
        "                if dd == d and di > i:\n",
        "                if False:\n",
        "tests/test_custom_schedules.py::test_a_broken_schedule_names_the_action_and_what_it_breaks",
    ),
    Mutation(
        "cut_cost_key_without_the_programs",
        "jaxpipe/cuts/part_costs.py",
        '    text = "\\n".join([traced, d.platform, getattr(d, "device_kind", ""), jax.__version__, code])\n',
        '    text = "\\n".join([d.platform, getattr(d, "device_kind", ""), jax.__version__, code])\n',
        "tests/test_cut_costs.py::test_two_models_never_share_a_cut_cost_key",
    ),
    Mutation(
        "model_key_without_dtypes",
        "jaxpipe/tune/measure_cache.py",
        '    return str([(tuple(np.shape(a)), str(getattr(a, "dtype", type(a)))) for a in '
        "jax.tree.leaves(tree)])\n",
        "    return str([tuple(np.shape(a)) for a in jax.tree.leaves(tree)])\n",
        "tests/test_measure_cache.py::test_optimizers_whose_states_differ_only_in_dtype_get_two_keys",
    ),
    Mutation(
        "runner_up_never_compiled",
        "jaxpipe/tune/configure.py",
        "        check = [c for c in ok[:2] if c.compiled_memory is None]\n",
        "        check = [c for c in ok[:1] if c.compiled_memory is None]\n",
        "tests/test_configure.py::test_the_choice_and_the_runner_up_are_both_compiled_before_they_are_trusted",
    ),
    Mutation(
        "placement_tie_by_name",
        "jaxpipe/schedules/lanes.py",
        '        p: (round(lockstep_step(s, p, costs), 9), s.plan(p).stash_capacity, p) for p in ("ordered", "lanes")\n',
        '        p: (round(lockstep_step(s, p, costs), 9), p) for p in ("ordered", "lanes")\n',
        "tests/test_lockstep_model.py::test_a_placement_tie_goes_to_the_plan_with_fewer_stash_slots",
    ),
    # a chunked checkpoint read in the reader's layout on another number of devices (blocks swapped, silently)
    Mutation(
        "chunked_restore_in_the_readers_layout",
        "jaxpipe/checkpoint.py",
        "        return theirs[0], mine[1]\n",
        "        return mine[0], mine[1]\n",
        "tests/test_chunk_state.py::test_a_chunked_checkpoint_restores_onto_another_number_of_devices[zb_v-devices0]",
    ),
    # a run ending on an error drops its checkpointer unclosed (the write in flight lost, the lock kept)
    Mutation(
        "error_path_drops_the_checkpointer",
        "jaxpipe/training/loop.py",
        "            # unbounded close for minutes), the lock is released, and the error goes to the caller\n"
        "            self._close_checkpointer_after_error()\n",
        "            # unbounded close for minutes), the lock is released, and the error goes to the caller\n"
        "            self.ckpt = None\n",
        "tests/test_trainer_api.py::test_a_run_that_ends_on_an_error_keeps_its_checkpoints_and_frees_the_directory[raises-OSError-saved0]",
    ),
    Mutation(
        "refused_resume_keeps_the_lock",
        "jaxpipe/training/loop.py",
        "        except BaseException:  # "
        "a refused resume: the "
        "directory's lock goes with the "
        "error\n            "
        "self._close_checkpointer_after_error()\n",
        "        except BaseException:  # a refused resume: the directory's lock goes with the error\n      "
        "      pass\n",
        "tests/test_trainer_api.py::test_a_refused_resume_frees_the_directory_for_the_right_model",
    ),
    # a refused state's refusal tied to its first array's identity: a copy of it is written
    Mutation(
        "refusal_tied_to_identity",
        "jaxpipe/checks/on_device.py",
        "        why = self._tainted_values.get(digest)\n",
        "        why = None\n",
        "tests/test_step_checks.py::test_a_refusal_follows_the_states_values_into_copies_and_their_descendants",
    ),
    # a batches function returning one shared iterator taken as a stream that starts over
    Mutation(
        "shared_iterator_taken",
        "jaxpipe/training/streams.py",
        "        if it is self._it:\n",
        "        if False:\n",
        "tests/test_trainer_api.py::test_a_batches_function_that_returns_one_shared_iterator_is_refused_with_the_fix",
    ),
    # the model key traced with a context of shape placeholders (a stage testing its mask fails)
    Mutation(
        "model_key_context_of_placeholders",
        "jaxpipe/tune/measure_cache.py",
        "    stage = lambda w, x, b: model.apply_stage(w, x, model.example_context(b))\n",
        "    stage = lambda w, x, b, ctx=model.example_context(mb): model.apply_stage(w, x, ctx)\n",
        "tests/test_measure_cache.py::test_a_model_whose_stages_read_a_mask_gets_a_key_from_shape_placeholders",
    ),
    # configure: a NaN budget taken as no limit; a cache file of another shape read; a cut record of another
    # shape
    Mutation(
        "nan_budget_taken_as_no_limit",
        "jaxpipe/tune/configure.py",
        "    if isinstance(memory_budget, bool) or not budget > 0:  # NaN, 0, negative, not a number\n",
        "    if isinstance(memory_budget, bool) or budget <= 0:  # NaN, 0, negative, not a number\n",
        "tests/test_configure.py::test_every_argument_is_checked_before_anything_is_measured[budget_nan]",
    ),
    Mutation(
        "measurements_of_another_shape_read",
        "jaxpipe/tune/measure_cache.py",
        "            if not isinstance(data, dict):\n",
        "            if False:\n",
        "tests/test_measure_cache.py::test_a_bad_measurements_file_is_named_set_aside_and_measured_again[[1, 2, 3]]",
    ),
    Mutation(
        "cut_record_of_another_shape_read",
        "jaxpipe/cuts/part_costs.py",
        "    if not _valid_rounds(rounds):\n",
        "    if rounds is None:\n",
        'tests/test_measure_cache.py::test_a_bad_cut_costs_file_is_named_set_aside_and_not_read[{"rounds": '
        '[{"f_block": 1.0}]}]',
    ),
    # a split backward priced as b + w (ZB-H1 drawn slower than 1F1B)
    Mutation(
        "split_backward_priced_on_top",
        "jaxpipe/schedules/simulate.py",
        "    return b - w, w\n",
        "    return b, w\n",
        "tests/test_schedules.py::test_b_is_the_whole_backward_for_every_schedule",
    ),
    # ... and the two weak kills: the loop's refusal without its finiteness check; the data split of a
    # prediction
    Mutation(
        "loop_refusal_only_on_the_skip_flag",
        "jaxpipe/training/loop.py",
        '        return bool(metrics.get("skipped", False)) or not finite\n',
        '        return bool(metrics.get("skipped", False))\n',
        "tests/test_trainer_api.py::test_a_step_is_refused_on_its_loss_and_grad_norm_not_only_on_a_skip_flag",
    ),
    Mutation(
        "chimera_ops_timed_over_one_stage",
        "jaxpipe/tune/running_costs.py",
        "    return 1 + len(away)\n",
        "    return 1\n",
        "tests/test_running_costs.py::"
        "test_chimera_times_its_ops_over_its_stage_and_replica_and_warns_against_1f1b_at_one_stage",
    ),
    Mutation(
        "chimera_warns_against_1f1b_at_its_own_costs",
        "jaxpipe/tune/running_costs.py",
        "    f, b, w, tick = costs if ref_costs is None else ref_costs\n",
        "    f, b, w, tick = costs\n",
        "tests/test_running_costs.py::"
        "test_chimera_times_its_ops_over_its_stage_and_replica_and_warns_against_1f1b_at_one_stage",
    ),
    Mutation(
        "probe_times_the_fused_backward",
        "jaxpipe/tune/microbench.py",
        "        self.split = sp if in_place and sp is not None and sp.in_place else None\n",
        "        self.split = None\n",
        "tests/test_running_costs.py::"
        "test_the_probes_backward_adds_the_weight_gradient_in_place_as_the_executor_does",
    ),
    Mutation(
        "probe_w_recomputes_its_input_part",
        "jaxpipe/tune/microbench.py",
        "        if front is not None:\n            return self.at_frontier.weight_part_into(",
        "        if False:\n            return self.at_frontier.weight_part_into(",
        "tests/test_running_costs.py::test_the_probes_w_runs_the_weight_products_alone_from_the_frontier",
    ),
    Mutation(
        "w_priced_as_the_whole_less_its_input_part",
        "jaxpipe/tune/running_costs.py",
        "    if at_frontier:  # the weight products alone",
        "    if False:  # the weight products alone",
        "tests/test_running_costs.py::test_a_split_backwards_weight_part_is_timed_as_the_w_lane_runs_it",
    ),
    Mutation(
        "steal_never_warned",
        "experiments/bench.py",
        "    if steal is not None and steal > STOLEN:\n",
        "    if False:\n",
        "tests/test_bench.py::test_a_hypervisors_steal_is_read_on_the_runs_cores_and_warned_about",
    ),
    Mutation(
        "chimera_priced_at_every_op_switching",
        "jaxpipe/tune/running_costs.py",
        "    blend = lambda a, b: a + rate * (b - a)\n",
        "    blend = lambda a, b: b\n",
        "tests/test_running_costs.py::"
        "test_chimera_times_its_ops_over_its_stage_and_replica_and_warns_against_1f1b_at_one_stage",
    ),
    Mutation(
        "traced_state_reaches_the_checks",
        "jaxpipe/checks/batch.py",
        "    if any(isinstance(v, jax.core.Tracer) for v in leaves):\n",
        "    if False:\n",
        "tests/test_step_checks.py::test_a_call_inside_a_jax_transformation_says_to_call_it_from_python",
    ),
    Mutation(
        "stop_vote_read_at_once",
        "jaxpipe/training/stopping.py",
        "        return None if previous is None else np.asarray(previous).reshape(-1)\n",
        "        return np.asarray(self._pending).reshape(-1)\n",
        "tests/test_stop_agreement.py::test_overlapped_steps_read_the_peers_flags_one_vote_late",
    ),
    Mutation(
        "overlap_error_loses_the_step_ahead",
        "jaxpipe/training/loop.py",
        "            if ahead is not None:\n                try:\n",
        "            if False:\n                try:\n",
        "tests/test_trainer_api.py::test_an_overlapped_run_that_fails_keeps_the_record_of_the_step_before",
    ),
    Mutation(
        "overlap_reads_past_an_evaluation",
        "jaxpipe/training/loop.py",
        "            or bool(self.eval_batches and o.eval_every and done % o.eval_every == 0)\n",
        "",
        "tests/test_trainer_api.py::test_overlapped_steps_log_train_and_evaluate_as_steps_read_one_by_one",
    ),
    Mutation(
        "overlap_reads_past_a_checkpoint",
        "jaxpipe/training/loop.py",
        "            or (self.ckpt is not None and self.ckpt.due(done))\n",
        "",
        "tests/test_trainer_api.py::test_a_run_that_ends_on_an_error_keeps_its_checkpoints_and_frees_the_directory"
        "[raises-OSError-saved0]",
    ),
    Mutation(
        "loop_refusal_only_on_the_skip_flag_end_to_end",
        "jaxpipe/training/loop.py",
        '        return bool(metrics.get("skipped", False)) or not finite\n',
        '        return bool(metrics.get("skipped", False))\n',
        "tests/test_trainer_api.py::test_without_skip_nonfinite_a_nan_step_stops_the_loop_by_name",
    ),
    Mutation(
        "prediction_ignores_the_data_split",
        "jaxpipe/tune/configure.py",
        "        rows = bench.rows // (c.data * c.microbatches)\n",
        "        rows = bench.rows // c.microbatches\n",
        "tests/test_configure.py::test_each_candidates_stage_is_predicted_at_its_own_micro_batch_rows",
    ),
    # the loss sums forwarded by XLA from an earlier phase's loop: the loss's all-reduces unordered against
    # the last loop
    Mutation(
        "loss_left_in_an_earlier_loop",
        "jaxpipe/runtime/ticks.py",
        "    loss = jax.tree.map(lambda x: jnp.where(written, x, jnp.zeros_like(x)), state.loss)\n",
        "    loss = state.loss\n",
        "tests/test_collective_order.py::test_the_loss_leaves_the_last_loop_of_a_phased_call",
    ),
    # the loss sums a loop output for XLA's passes only (an optimization barrier): the last loop passes them
    # through, and the runtime starts the loss's all-reduce beside it (ZB-H1 on four devices deadlocked)
    Mutation(
        "loss_passed_through_the_last_loop",
        "jaxpipe/runtime/ticks.py",
        "    loss = jax.tree.map(lambda x: jnp.where(written, x, jnp.zeros_like(x)), state.loss)\n",
        "    loss, _ = lax.optimization_barrier((state.loss, tick_index))\n",
        "tests/test_collective_order.py::test_what_follows_the_loops_waits_for_them_in_the_runtime[zb_h1]",
    ),
    # the persistent cache kept on the first jaxlib whose cached CPU programs deadlock across processes
    Mutation(
        "cached_programs_kept_where_they_deadlock",
        "jaxpipe/distributed.py",
        "        or _jaxlib_version() < CACHED_CPU_PROGRAMS_DEADLOCK_FROM\n",
        "        or _jaxlib_version() <= CACHED_CPU_PROGRAMS_DEADLOCK_FROM\n",
        "tests/test_multihost.py::test_the_cache_is_turned_off_only_where_its_programs_deadlock",
    ),
    # the model's ranking kept where two plans are too close for it: the slower plan as timed runs
    Mutation(
        "timed_plans_ranked_the_wrong_way",
        "jaxpipe/tune/running_costs.py",
        '    return "ordered" if ordered < lanes else "lanes"\n',
        '    return "ordered" if ordered > lanes else "lanes"\n',
        "tests/test_running_costs.py::"
        "test_plans_predicted_too_close_to_rank_are_timed_and_the_faster_runs_exactly",
    ),
    Mutation(
        "timing_trades_memory_for_noise",
        "jaxpipe/tune/running_costs.py",
        "    return slots[1] <= 2 * slots[0] and abs(ordered / lanes - 1.0) < TIME_WITHIN\n",
        "    return abs(ordered / lanes - 1.0) < TIME_WITHIN\n",
        "tests/test_running_costs.py::"
        "test_plans_are_too_close_to_rank_within_the_models_error_but_not_when_equal",
    ),
    Mutation(
        "ties_timed_as_close_calls",
        "jaxpipe/tune/running_costs.py",
        "    if ordered == lanes:  # a tie is no close call: the plan with fewer stash slots wins it\n",
        "    if False:\n",
        "tests/test_running_costs.py::"
        "test_plans_are_too_close_to_rank_within_the_models_error_but_not_when_equal",
    ),
    # each process keeps its own plan times: two processes may compile different plans and hang
    Mutation(
        "timed_plans_not_agreed_across_processes",
        "jaxpipe/tune/running_costs.py",
        "    ordered, lanes = _kept(store, key, time_plans)\n",
        "    ordered, lanes = time_plans()\n",
        "tests/test_multihost.py::test_two_processes_run_the_plan_process_0_timed_faster",
    ),
    # Chimera's replicas moved over the link left out of its prediction: 0.81-0.89x 1F1B where it ran 1.05-1.08x
    Mutation(
        "chimera_layout_left_out",
        "jaxpipe/tune/running_costs.py",
        "    mine = predicted_step(s, placement, costs) + layout\n",
        "    mine = predicted_step(s, placement, costs)\n",
        "tests/test_running_costs.py::"
        "test_chimeras_replicas_moved_over_the_link_count_in_its_prediction_against_1f1b",
    ),
    # the replica probe allocates the whole stage: three stage-sized arrays at the first step of a big model
    Mutation(
        "replica_probe_uncapped",
        "jaxpipe/tune/microbench.py",
        "    big = int(min(max(stage_bytes, 1 << 12), largest)) // 4 * 4\n",
        "    big = int(max(stage_bytes, 1 << 12)) // 4 * 4\n",
        "tests/test_running_costs.py::"
        "test_a_replica_larger_than_the_probe_allocates_is_priced_on_the_line_through_two_sizes",
    ),
    # a tick priced on even ticks alone: the exchange of a tick where no device waits, half what plans pay
    Mutation(
        "tick_priced_on_even_ticks",
        "jaxpipe/tune/running_costs.py",
        '    return max(per_tick["uneven"], per_tick["even"], per_tick["alone"]) - per_tick["alone"]\n',
        '    return max(per_tick["even"], per_tick["alone"]) - per_tick["alone"]\n',
        "tests/test_running_costs.py::test_a_ticks_price_is_measured_on_uneven_and_even_ticks_the_dearer_kept",
    ),
    # a tick priced on uneven ticks alone: the busier device's faster ops beside an idle one price it free
    Mutation(
        "tick_priced_on_uneven_ticks_alone",
        "jaxpipe/tune/running_costs.py",
        '    return max(per_tick["uneven"], per_tick["even"], per_tick["alone"]) - per_tick["alone"]\n',
        '    return max(per_tick["uneven"], per_tick["alone"]) - per_tick["alone"]\n',
        "tests/test_running_costs.py::test_a_ticks_price_is_measured_on_uneven_and_even_ticks_the_dearer_kept",
    ),
    # a tick priced from one measurement: one stray difference of two loops places a plan
    Mutation(
        "tick_priced_from_one_measurement",
        "jaxpipe/tune/running_costs.py",
        "    return float(np.median(prices))\n",
        "    return prices[0]\n",
        "tests/test_running_costs.py::test_a_ticks_price_is_the_median_of_repeated_measurements",
    ),
    # the benchmark rounds time each run's first step after another run's: the run timed first looks slow
    Mutation(
        "rounds_time_the_first_step_after_another_run",
        "experiments/bench.py",
        "def round_steps(runs, rounds: int, settle: int = 1):\n",
        "def round_steps(runs, rounds: int, settle: int = 0):\n",
        "tests/test_bench.py::test_each_runs_timed_steps_follow_an_untimed_one_of_its_own",
    ),
    # the tick probe repeated five times whatever a repeat costs: 73-77 s of a first step at a 2048-wide stage
    Mutation(
        "tick_probe_ignores_its_budget",
        "jaxpipe/tune/running_costs.py",
        "    return _runs_that_fit(first_repeat_s, budget_s, 1, MOST_REPEATS)\n",
        "    return MOST_REPEATS\n",
        "tests/test_running_costs.py::test_the_tick_probe_repeats_as_often_as_its_first_repeats_time_allows[15.6-1]",
    ),
    # a first step that spent long measuring says nothing of it
    Mutation(
        "slow_first_step_says_nothing",
        "jaxpipe/pipeline.py",
        "        if took > SLOW_FIRST_STEP_S and jax.process_index() == 0:\n",
        "        if False:\n",
        "tests/test_running_costs.py::test_a_slow_first_step_says_it_measured_and_where_the_costs_are_kept",
    ),
    # W alone timed only where this process's timings hid it: processes run different probes and deadlock
    Mutation(
        "w_alone_timed_only_where_this_process_needs_it",
        "jaxpipe/tune/running_costs.py",
        '    alone = timed(split=True, kinds=["W"])["W"][-1]  # timed whatever',
        '    alone = timed(split=True, kinds=["W"])["W"][-1] if at_frontier or ops["B"][-1] <= b_in else 0  #',
        "tests/test_running_costs.py::test_every_process_runs_the_same_probes_whatever_its_own_timings_say",
    ),
    # a weight part the timings' noise hides priced free: the zero-bubble planner would think W costs nothing
    Mutation(
        "w_priced_free_under_noise",
        "jaxpipe/tune/running_costs.py",
        "    return (f, b_in, min(alone, whole))  # the timings' noise hides W: timed alone, an upper bound\n",
        "    return (f, b_in, 0.0)\n",
        "tests/test_running_costs.py::"
        "test_a_weight_part_the_timings_noise_hides_is_timed_alone_not_priced_free",
    ),
    Mutation(
        "w_timed_as_the_whole_backward",
        "jaxpipe/tune/running_costs.py",
        "        return (f, b_in, whole - b_in)\n",
        "        return (f, b_in, whole)\n",
        "tests/test_running_costs.py::"
        "test_a_split_backwards_weight_part_is_timed_as_the_w_lane_runs_it[False]",
    ),
    Mutation(
        "measured_costs_not_placed_for",
        "jaxpipe/pipeline.py",
        "        self._place(self.op_costs)\n",
        "        self._place(None)\n",
        "tests/test_running_costs.py::"
        "test_the_first_step_measures_the_costs_chooses_the_ticks_for_them_and_stays_exact",
    ),
    # the search's predictions without a tick's rendezvous (two-chunk plans' many ticks ranked as free)
    Mutation(
        "configure_ticks_without_rendezvous",
        "jaxpipe/tune/configure.py",
        "            rendezvous=rendezvous,\n",
        "            rendezvous=0.0,\n",
        "tests/test_configure.py::test_every_tick_of_a_pipelined_candidate_pays_the_measured_rendezvous",
    ),
    # close plans timed by the least of three calls (ranked 4-7% apart plans the wrong way on the testbed)
    Mutation(
        "close_plans_timed_three_calls",
        "jaxpipe/pipeline.py",
        "        for _ in range(plan_timing_rounds(sum(first)) if calls is None else calls):\n",
        "        for _ in range(3 if calls is None else calls):\n",
        "tests/test_running_costs.py::test_close_plans_are_timed_for_as_many_rounds_as_fit_the_budget",
    ),
    Mutation(
        "plan_timing_ignores_its_budget",
        "jaxpipe/tune/running_costs.py",
        "    return int(_process_0s(np.int32(_runs_that_fit(round_s, budget_s, *PLAN_TIMING_ROUNDS))))\n",
        "    return int(_process_0s(np.int32(PLAN_TIMING_ROUNDS[0])))\n",
        "tests/test_running_costs.py::test_close_plans_are_timed_for_as_many_rounds_as_fit_the_budget",
    ),
    # a runner's flags defined on import: two runners imported together clash (DuplicateFlagError)
    Mutation(
        "runner_flags_defined_on_import",
        "experiments/accelerator_cost.py",
        "\n\nFLAGS = flags.FLAGS\n",
        "\n\ndefine_flags()\nFLAGS = flags.FLAGS\n",
        "tests/test_runner_help.py::test_every_runner_imports_beside_every_other_without_defining_a_flag",
    ),
    Mutation(
        "runner_flags_defined_twice",
        "jaxpipe/cli/train.py",
        "@functools.cache\ndef define_flags() -> None:\n",
        "def define_flags() -> None:\n",
        "tests/test_runner_help.py::test_a_runners_flag_definitions_run_once_however_often_asked",
    ),
    # a schedule of one's own on the command line
    Mutation(
        "schedule_file_ignores_its_m",
        "jaxpipe/cli/common.py",
        '    path = value.replace("{M}", str(microbatches))\n',
        "    path = value\n",
        "tests/test_custom_schedules.py::test_the_timeline_command_draws_a_schedule_file_and_names_what_breaks_one",
    ),
    Mutation(
        "train_schedule_file_stages_unchecked",
        "jaxpipe/cli/train.py",
        '        ("stages", FLAGS.stages, own.D),\n',
        "",
        "tests/test_custom_schedules.py::test_the_train_command_refuses_a_schedule_file_for_other_devices_or_micro_batches",
    ),
    Mutation(
        "from_csv_reads_a_missing_path_as_text",
        "jaxpipe/schedules/custom.py",
        '    if not is_path and "\\n" not in source and (source.endswith(".csv") or os.sep in source):\n',
        "    if False:\n",
        "tests/test_custom_schedules.py::test_a_missing_csv_file_is_named_not_read_as_the_schedules_text",
    ),
    Mutation(
        "built_schedule_told_to_change_the_mesh",
        "jaxpipe/checks/arguments.py",
        "    if sched.num_model_stages != model.num_stages and built is not None:\n",
        "    if sched.num_model_stages != model.num_stages and built is None:\n",
        "tests/test_custom_schedules.py::test_pipeline_takes_a_users_schedule_only_as_built",
    ),
    Mutation(
        "async_checkpoint_resumes_under_another_schedule",
        "jaxpipe/checkpoint.py",
        '    both = bool(saved.get("synchronous")) and bool(mine.get("synchronous"))\n',
        "    both = True\n",
        "tests/test_checkpoint.py::test_a_synchronous_checkpoint_resumes_under_another_synchronous_schedule_and_m",
    ),
    Mutation(
        "checkpoint_resumes_under_another_chunk_order",
        "jaxpipe/checkpoint.py",
        '    return both and saved.get("state_layout") == mine.get("state_layout")\n',
        "    return both\n",
        "tests/test_checkpoint.py::test_a_synchronous_checkpoint_resumes_under_another_synchronous_schedule_and_m",
    ),
]


def _copy() -> str:
    dst = tempfile.mkdtemp(prefix="jaxpipe-mutant-")
    shutil.copytree(
        ROOT,
        dst,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns(".git", "runs", "out", "__pycache__", "*.egg-info", ".pytest_cache"),
    )
    return dst


def run(m: Mutation, timeout: float = 900) -> str:
    """``"caught"``, ``"MISSED"``, ``"stale"`` or ``"error ..."`` for one mutation."""
    dst = _copy()
    try:
        path = os.path.join(dst, m.path)
        text = open(path).read()
        if text.count(m.old) != 1:
            return "stale"
        open(path, "w").write(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=dst)
        env.pop("JAXPIPE_TEST_SAMPLE", None)
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", m.test],
            cwd=dst,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # pytest's 1: a test failed (caught); 0: passed (missed); anything else (no such test, a collection
        # error, an interrupted run) says nothing about the mutation
        return {0: "MISSED", 1: "caught"}.get(p.returncode, f"error (pytest exit {p.returncode})")
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def main(argv) -> int:
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.path}  ->  {m.test}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    bad = 0
    for m in chosen:
        verdict = run(m)
        bad += verdict != "caught"
        print(f"{verdict:7s} {m.name:28s} {m.test}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
