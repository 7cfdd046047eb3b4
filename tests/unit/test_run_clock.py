"""The run's clock (orchestrator/clock.py): the timing columns of a step's row and the wall time
across a resume, on a hand-driven clock."""

from asyncrl.orchestrator.clock import RunClock


class Hand:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_steps_timing_columns_say_where_its_time_went():
    now = Hand()
    clock = RunClock(now)
    clock.begin()
    now.t = 103.0  # the learner idle 3 s, waiting for a batch
    clock.step_started(lambda: setattr(now, "t", 103.5))  # sending the batch takes 0.5 s of the loop
    clock.generated(40, training=True)
    clock.generated(7, training=False)  # before the step, or between steps: not overlap
    now.t = 110.0
    clock.step_done()
    now.t = 111.0  # the push
    clock.pushed()
    assert clock.columns() == {"timing/train_s": 7.0, "timing/wait_for_data_s": 3.0, "timing/loop_s": 0.5,
                               "throughput/gen_tokens_while_training": 40}
    now.t = 111.25  # the row, a checkpoint
    clock.row_done()
    assert clock.last_step == 110.0  # the stall watch counts from the step's end
    now.t = 112.0
    clock.step_started(lambda: setattr(now, "t", 112.5))
    now.t = 114.0
    clock.step_done()
    clock.pushed()
    # the loop's work after the last push and this step's start; the learner waited since 110
    assert clock.columns() == {"timing/train_s": 2.0, "timing/wait_for_data_s": 2.0, "timing/loop_s": 0.75,
                               "throughput/gen_tokens_while_training": 0}


def test_the_wall_time_counts_the_time_before_a_resume_and_the_summary_says_where_it_resumed():
    now = Hand()
    clock = RunClock(now)
    assert clock.resume_summary() == {}
    clock.begin()
    clock.resumed(elapsed_s=50.0, step=8)
    now.t = 130.0
    assert clock.elapsed_s() == 80.0
    assert clock.resume_summary() == {"resumed_at_step": 8, "wall_s_since_resume": 30.0}
    now.t = 140.0
    clock.rewound()  # a learner restart: the stall watch starts again, the wall time goes on
    assert clock.last_step == 140.0 and clock.elapsed_s() == 90.0
