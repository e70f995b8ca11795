"""The replica routing policy without Ray (`pytgi.api.replicas.affinity`): prompts sharing a prefix go
where it was sent before, unless that replica is overloaded; new prefixes spread out; round robin
takes turns; a dead replica's picture is dropped."""

import pytest

from pytgi.api.replicas.affinity import Affinity, PrefixIndex, block_chain

SYSTEM_A = list(range(1000, 1064))  # 4 blocks of 16
SYSTEM_B = list(range(2000, 2064))


def first(ranks):
    return ranks[0][0]


def test_block_chain_hashes_full_blocks_each_after_the_ones_before():
    a = block_chain(SYSTEM_A + [1, 2, 3], 16)
    assert len(a) == 4  # the partial block is not cached, so it is not hashed
    assert block_chain(SYSTEM_A + [9], 16) == a
    b = block_chain([0] * 16 + SYSTEM_A[16:], 16)
    assert b[0] != a[0] and b[1] != a[1]  # a block's hash depends on the blocks before it
    assert block_chain(SYSTEM_A, 16, root="adapter") != a  # the adapter's blocks are its own


def test_prefix_index_matches_leading_blocks_and_forgets_the_least_recent():
    index = PrefixIndex(capacity=6)
    a, b = block_chain(SYSTEM_A, 16), block_chain(SYSTEM_B, 16)
    index.insert("r1", a)
    assert index.match("r1", a) == 4 and index.match("r1", a[:2] + b[2:]) == 2 and index.match("r2", a) == 0
    index.insert("r1", b)  # 8 blocks > 6: a's first two go
    assert index.size("r1") == 6 and index.match("r1", a) == 0 and index.match("r1", b) == 4
    index.drop("r1")
    assert index.match("r1", b) == 0


def test_shared_prefixes_stick_to_their_replica_and_new_ones_spread():
    aff = Affinity("prefix", block_size=16)
    replicas = ["r1", "r2"]
    loads = {"r1": 0, "r2": 0}
    a = block_chain(SYSTEM_A + [1], 16)
    where_a = first(aff.rank(replicas, loads, a))
    aff.routed(where_a, a)
    loads[where_a] += 1
    b = block_chain(SYSTEM_B + [2], 16)
    where_b = first(aff.rank(replicas, loads, b))  # the other one: lighter, and holding nothing
    assert where_b != where_a
    aff.routed(where_b, b)
    loads[where_b] += 1
    for user in range(3):  # more users of each system prompt: each to its prefix's replica
        assert first(aff.rank(replicas, loads, block_chain(SYSTEM_A + [10 + user], 16))) == where_a
        assert first(aff.rank(replicas, loads, block_chain(SYSTEM_B + [20 + user], 16))) == where_b


def test_an_overloaded_replica_loses_its_prefix_to_the_least_loaded():
    aff = Affinity("prefix", block_size=16, max_imbalance=4)
    a = block_chain(SYSTEM_A, 16)
    aff.routed("r1", a)
    assert first(aff.rank(["r1", "r2"], {"r1": 3, "r2": 0}, a)) == "r1"  # within the imbalance allowed
    ranks = aff.rank(["r1", "r2"], {"r1": 4, "r2": 0}, a)
    assert ranks == [["r2"], ["r1"]]  # over it: the least loaded, the affine one next


def test_round_robin_takes_turns_whatever_the_prompt():
    aff = Affinity("round-robin")
    a = block_chain(SYSTEM_A, 16)
    picks = [first(aff.rank(["r2", "r1", "r3"], {}, a)) for _ in range(6)]
    assert picks == ["r1", "r2", "r3", "r1", "r2", "r3"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        Affinity("random")


def test_the_deployment_gets_a_fixed_count_or_the_autoscalers_bounds():
    pytest.importorskip("ray.serve")
    from pytgi.api.replicas.client import ReplicaOptions, deployment_options
    from pytgi.core.config import EngineConfig

    config = EngineConfig(block_size=16, max_batch_total_tokens=4096)
    fixed = deployment_options(ReplicaOptions(3), config)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    router = fixed["request_router_config"]
    assert router.request_router_class.endswith("PrefixAffinityRouter")
    assert router.request_router_kwargs == {"policy": "prefix", "block_size": 16, "capacity": 256}
    scaled = deployment_options(
        ReplicaOptions(2, min_replicas=1, max_replicas=4, policy="round-robin"), config
    )
    auto = scaled["autoscaling_config"]
    assert "num_replicas" not in scaled
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 4, 2)
    assert auto.target_ongoing_requests == 8.0  # requests in flight a replica: the queue depth it aims at
    assert scaled["request_router_config"].request_router_kwargs["policy"] == "round-robin"


def test_a_prompt_cache_key_keeps_a_conversation_on_its_replica():
    """OpenAI's prompt_cache_key: requests sharing it go where it went, however their prompts differ
    (short ones included, whose blocks alone would match nothing), within the load bound."""
    from pytgi.api.replicas.affinity import submit_chain
    from pytgi.core import protocol as P
    from pytgi.core.sampling_params import SamplingParams

    def chain(prompt: list[int], key: str | None) -> list[int]:
        return submit_chain(P.encoder.encode(P.Submit("r", prompt, SamplingParams(), [], key)), 16)

    assert chain([1, 2, 3], None) == []  # no full block: nothing to match by
    assert chain([1, 2, 3], "conv-1")[0] == chain([9] * 40, "conv-1")[0] != chain([1, 2, 3], "conv-2")[0]
    assert chain(SYSTEM_A, "conv-1")[1:] != chain(SYSTEM_A, None)  # keyed blocks are a chain of their own
    aff = Affinity("prefix", block_size=16)
    replicas, loads = ["r1", "r2"], {"r1": 0, "r2": 0}
    first_turn = chain([5, 6, 7], "conv-1")
    home = first(aff.rank(replicas, loads, first_turn))
    aff.routed(home, first_turn)
    loads[home] += 1
    other = chain([5, 6, 7], "conv-2")  # same words, another conversation: spreads to the other replica
    assert first(aff.rank(replicas, loads, other)) != home
    for turn in range(3):  # later turns of conv-1, each prompt different
        assert first(aff.rank(replicas, loads, chain([40 + turn] * (8 + 20 * turn), "conv-1"))) == home
