"""`bench/probes/budget_cost.py` stays runnable and times what it says."""
import pytest


def test_budget_cost_times_a_commit_of_the_budgets_learning():
    from bench.probes.budget_cost import main

    result = main(["--commits", "200", "--rounds", "2"])
    assert len(result["us_per_commit"]) == 2 and all(0 < us < 100_000 for us in result["us_per_commit"])


def test_budget_cost_refuses_what_it_cannot_time():
    from bench.probes.budget_cost import main

    with pytest.raises(SystemExit):
        main(["--spacing-ms", "0"])
