"""RUN_DIR/loss.png: the loss curves and, below, each learner's throughput."""
from wan_diloco.runtime.run_plot import plot_run, rates


def test_throughput_is_tokens_per_second_between_readings_and_a_restart_starts_over():
    assert rates([(0.0, 0), (2.0, 1000), (4.0, 3000), (5.0, 100), (6.0, 600)]) == [
        (2.0, 500.0), (4.0, 1000.0), (6.0, 500.0)]
    assert rates([(1.0, 10)]) == []


def test_the_picture_has_a_throughput_panel_when_there_are_readings(tmp_path):
    import matplotlib.image

    losses = {0: [(1, 5.0), (2, 4.0)], 1: [(1, 5.1), (2, 4.2)]}
    plot_run(losses, [{"step": 2, "eval_loss": 4.1}], [5.5], [(2, 4.0)], tmp_path / "a.png")
    plot_run(losses, [{"step": 2, "eval_loss": 4.1}], [5.5], [(2, 4.0)], tmp_path / "b.png",
             tokens={0: [(0.0, 0), (1.0, 500), (2.0, 1000)], 1: [(0.5, 0), (1.5, 400)]})
    one, two = (matplotlib.image.imread(tmp_path / n) for n in ("a.png", "b.png"))
    assert two.shape[0] > 1.4 * one.shape[0]  # a second panel below the loss


def _spec(**tables):
    from wan_diloco import spec as spec_lib

    return spec_lib.from_document(tables)


def test_the_title_names_the_users_model_and_the_unit_follows_the_tokenizer(tmp_path):
    from wan_diloco.runtime.run_plot import plot_labels

    assert plot_labels(_spec()) == {"title": f"{_spec().run.learners} learners, {_spec().run.steps} steps (tiny)",
                                    "ylabel": "loss (nats per byte)"}
    user = _spec(model={"module": "tests/fixtures/user_model.py:make"})
    assert plot_labels(user)["title"].endswith("(user_model.py:make)")
    assert plot_labels(_spec(model={"module": "mypkg.models:small"}))["title"].endswith("(mypkg.models:small)")
    bpe = _spec(data={"tokenizer": "tok.json"}, model={"vocab_size": 1024})
    assert plot_labels(bpe)["ylabel"] == "loss (nats per token)"
    ids = _spec(data={"corpus": "tokens.npy"})
    assert plot_labels(ids)["ylabel"] == "loss (nats per token)"


def test_the_picture_carries_the_labels_it_is_given(tmp_path, monkeypatch):
    import matplotlib.figure

    seen = {}

    def record(fig, path, **kw):
        ax = fig.axes[0]
        seen.update(title=ax.get_title(), ylabel=ax.get_ylabel())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot_run({0: [(1, 5.0)]}, [], [5.5], [(1, 5.0)], tmp_path / "a.png", title="2 learners, 9 steps (MyLM)",
             ylabel="loss (nats per token)")
    assert seen == {"title": "2 learners, 9 steps (MyLM)", "ylabel": "loss (nats per token)"}
