#include "server/pace_lead_tuner.h"

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Times versions [from, to) at `ms(lead)` each; returns their leads.
template <typename StepMs>
std::vector<int> RunSteps(PaceLeadTuner& tuner, int64_t from, int64_t to, StepMs ms) {
  std::vector<int> leads;
  for (int64_t v = from; v < to; ++v) {
    const int lead = tuner.LeadFor(v);
    leads.push_back(lead);
    tuner.StepTook(v, absl::Milliseconds(ms(lead, v)));
  }
  return leads;
}

TEST(PaceLeadTunerTest, TakesTheLastCandidateUntilATrialHasEnded) {
  PaceLeadTuner tuner({});
  EXPECT_EQ(tuner.chosen(), 2);
  // The trial: versions 2-17, four steps of each candidate in turn, twice.
  EXPECT_THAT(RunSteps(tuner, 0, 19, [](int, int64_t) { return 50.0; }),
              ElementsAre(2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 2));
  EXPECT_EQ(tuner.chosen(), 2);  // A tie keeps the lead chosen before.
  EXPECT_EQ(tuner.trial_summary(), "lead 1: 50.0 ms, lead 2: 50.0 ms; chose 2");
}

TEST(PaceLeadTunerTest, KeepsTheCandidateWithTheShorterMedianStepAndTriesAgainEachPeriod) {
  PaceLeadTuner tuner({});
  // Lead 1 is faster; one of its timed steps is an outlier the median ignores.
  auto one_faster = [](int lead, int64_t v) { return lead == 1 ? (v == 3 ? 900.0 : 80.0) : 100.0; };
  RunSteps(tuner, 0, 18, one_faster);
  EXPECT_EQ(tuner.chosen(), 1);
  EXPECT_EQ(tuner.trial_summary(), "lead 1: 80.0 ms, lead 2: 100.0 ms; chose 1");
  EXPECT_EQ(tuner.LeadFor(18), 1);
  EXPECT_EQ(tuner.LeadFor(257), 1);
  // The next trial runs versions 258-273; now lead 2 is faster.
  EXPECT_EQ(tuner.LeadFor(262), 2);
  RunSteps(tuner, 18, 274, [](int lead, int64_t) { return lead == 2 ? 70.0 : 100.0; });
  EXPECT_EQ(tuner.chosen(), 2);
  EXPECT_EQ(tuner.LeadFor(274), 2);
}

TEST(PaceLeadTunerTest, OnlyTheStepsInsideABlockAreTimed) {
  PaceLeadTuner tuner({});
  // Lead 1's blocks (versions 2-5 and 10-13) are slow at their edges, where
  // the step before or after ran with lead 2, and fast inside: what counts
  // is the inside.
  RunSteps(tuner, 0, 18, [](int lead, int64_t v) {
    if (lead == 2) return 100.0;
    return v == 2 || v == 5 || v == 10 || v == 13 ? 1000.0 : 90.0;
  });
  EXPECT_EQ(tuner.chosen(), 1);
}

TEST(PaceLeadTunerTest, ATrialThatMissedACandidateKeepsTheLead) {
  PaceLeadTuner tuner({.leads = {1, 2, 3}, .block_steps = 3, .rounds = 1});
  // The trial is versions 2-10 (leads 1, 2, 3 for three steps each); a job
  // restored at version 5 times only the steps of leads 2 and 3.
  EXPECT_FALSE(tuner.StepTook(6, absl::Milliseconds(10)));
  EXPECT_FALSE(tuner.StepTook(9, absl::Milliseconds(10)));
  EXPECT_TRUE(tuner.StepTook(10, absl::Milliseconds(10)));
  EXPECT_EQ(tuner.chosen(), 3);
  EXPECT_THAT(tuner.trial_summary(), HasSubstr("lead 1: not timed"));
  EXPECT_THAT(tuner.trial_summary(), HasSubstr("kept"));
  // Steps outside a trial are not counted.
  EXPECT_FALSE(tuner.StepTook(11, absl::Milliseconds(1)));
  EXPECT_FALSE(tuner.StepTook(1, absl::Milliseconds(1)));
}

TEST(PaceLeadTunerTest, SamplesOfAnEarlierTrialDoNotCountInTheNext) {
  PaceLeadTuner tuner({.block_steps = 3, .rounds = 1, .period = 10});
  // Trial one (versions 2-7) times only lead 1's step, fast.
  tuner.StepTook(3, absl::Milliseconds(10));
  // Trial two (12-17) times only lead 2's.
  tuner.StepTook(16, absl::Milliseconds(100));
  EXPECT_TRUE(tuner.StepTook(17, absl::Milliseconds(100)));
  EXPECT_EQ(tuner.chosen(), 2);
  EXPECT_THAT(tuner.trial_summary(), HasSubstr("lead 1: not timed"));
}

}  // namespace
}  // namespace pstrain
