#include "client/report.h"

#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::JobStatus SucceededJob() {
  v1::JobStatus s;
  s.set_job_id("job-7");
  s.set_name("fmnist");
  s.set_state(v1::JOB_STATE_SUCCEEDED);
  s.set_reason("all 2 workers finished");
  s.set_epoch(2);
  s.set_step(120);
  s.set_total_steps(120);
  s.set_runs(2);
  s.set_steps_lost(7);
  s.set_submitted_unix_ms(1'700'000'000'000);
  s.set_started_unix_ms(1'700'000'002'000);
  s.set_finished_unix_ms(1'700'000'062'000);
  v1::JobSpec* spec = s.mutable_spec();
  spec->set_name("fmnist");
  spec->set_epochs(2);
  spec->set_batch_size(64);
  spec->set_workers(2);
  spec->set_mode(v1::CONSISTENCY_SYNC);
  spec->set_precision(v1::PRECISION_BF16);
  spec->mutable_model()->set_name("fmnist-cnn");
  spec->mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
  spec->mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  spec->mutable_optimizer()->set_learning_rate(0.05f);
  // 3 classes: class 0 always right; class 1 half taken for 2; class 2
  // never predicted.
  v1::EvalMetrics* t = s.mutable_test();
  t->set_num_classes(3);
  for (int64_t n : {10, 0, 0, /**/ 0, 5, 5, /**/ 2, 8, 0}) t->add_confusion(n);
  t->set_samples(30);
  t->set_accuracy(0.5);
  t->set_loss(0.9);
  return s;
}

v1::JobHistory History(int points) {
  v1::JobHistory h;
  h.set_job_id("job-7");
  h.set_min_step_gap(1);
  for (int i = 0; i < points; ++i) {
    v1::HistoryPoint* p = h.add_points();
    p->set_step(i * 10);
    p->set_epoch(i / 6);
    p->set_loss(2.3 / (1 + i));
    p->set_train_accuracy(0.1 + 0.07 * i);
    p->set_samples_per_sec(1000 + i);
    p->set_run(i < 8 ? 1 : 2);
  }
  return h;
}

const absl::Time kNow = absl::FromUnixSeconds(1'700'000'100);

// The "points" attribute of the polyline inside <svg id="ID">.
std::vector<std::string> PolylinePoints(const std::string& html, const std::string& id) {
  const size_t svg = html.find("<svg id=\"" + id + "\"");
  if (svg == std::string::npos) return {};
  const size_t end = html.find("</svg>", svg);
  const std::string body = html.substr(svg, end - svg);
  std::smatch m;
  if (!std::regex_search(body, m, std::regex("<polyline [^>]*points=\"([^\"]*)\""))) return {};
  return absl::StrSplit(m[1].str(), ' ');
}

TEST(ReportTest, AFinishedJobHasItsCurvesHeatMapPerClassTableAndSpec) {
  const std::string html = RenderJobReport(SucceededJob(), History(12), kNow);
  EXPECT_THAT(html, HasSubstr("<!DOCTYPE html>"));
  EXPECT_THAT(html, HasSubstr("<title>job-7 \xC2\xB7 fmnist (SUCCEEDED)</title>"));
  // Self-contained: nothing fetched, nothing run.
  EXPECT_THAT(html, Not(HasSubstr("<script")));
  EXPECT_THAT(html, Not(HasSubstr("src=")));
  EXPECT_THAT(html, Not(HasSubstr("href=")));
  // One polyline point per history point, in plot coordinates: step 0 at
  // the left edge, the last at the right; the loss falls, so y grows.
  for (const char* id : {"loss-plot", "accuracy-plot", "throughput-plot"}) {
    EXPECT_EQ(PolylinePoints(html, id).size(), 12u) << id;
  }
  const std::vector<std::string> loss = PolylinePoints(html, "loss-plot");
  ASSERT_EQ(loss.size(), 12u);
  EXPECT_EQ(loss.front().substr(0, loss.front().find(',')), "64.0");
  EXPECT_EQ(loss.back().substr(0, loss.back().find(',')), "624.0");
  EXPECT_LT(std::stod(loss.front().substr(loss.front().find(',') + 1)),
            std::stod(loss.back().substr(loss.back().find(',') + 1)));
  // The second run is marked where it took over.
  EXPECT_THAT(html, HasSubstr("class=\"run\""));
  EXPECT_THAT(html, HasSubstr(">run 2</text>"));
  // The heat map: 9 cells, shaded by their share of the row: class 0's
  // diagonal is the darkest blue, an empty cell white.
  EXPECT_THAT(html, HasSubstr("<svg id=\"confusion\""));
  EXPECT_EQ(std::regex_search(html, std::regex("true 0, predicted 0: 10")), true);
  size_t cells = 0;
  for (size_t at = html.find("class=\"cell\""); at != std::string::npos;
       at = html.find("class=\"cell\"", at + 1)) {
    ++cells;
  }
  EXPECT_EQ(cells, 9u);
  EXPECT_THAT(html, HasSubstr("fill=\"#08306b\"><title>true 0, predicted 0: 10</title>"));
  EXPECT_THAT(html, HasSubstr("fill=\"#f7fbff\"><title>true 0, predicted 1: 0</title>"));
  // Per class: precision = TP / predicted, recall = TP / true, F1, support.
  // Class 0: 10/12, 10/10; class 1: 5/13, 5/10; class 2: never predicted.
  EXPECT_THAT(html, HasSubstr("<tr><td>0</td><td>0.8333</td><td>1.0000</td><td>0.9091</td>"
                              "<td>10</td></tr>"));
  EXPECT_THAT(html, HasSubstr("<tr><td>1</td><td>0.3846</td><td>0.5000</td><td>0.4348</td>"
                              "<td>10</td></tr>"));
  EXPECT_THAT(html, HasSubstr("<tr><td>2</td><td>0.0000</td><td>0.0000</td><td>0.0000</td>"
                              "<td>10</td></tr>"));
  EXPECT_THAT(html, HasSubstr("<td>50.00%</td>"));  // 15 of 30 right.
  // Timing, recovery and the spec as submittable JSON.
  EXPECT_THAT(html, HasSubstr("2023-11-14 22:13:20 UTC"));  // Submitted.
  EXPECT_THAT(html, HasSubstr("(queued 2.0 s)"));
  EXPECT_THAT(html, HasSubstr("(ran 1 min 00 s)"));
  EXPECT_THAT(html, HasSubstr("2 runs, 0 workers lost, 7 steps trained again"));
  EXPECT_THAT(html, HasSubstr("&quot;batch_size&quot;: 64"));
  EXPECT_THAT(html, HasSubstr("&quot;mode&quot;: &quot;CONSISTENCY_SYNC&quot;"));
  EXPECT_THAT(html, HasSubstr("<tr><th>precision</th><td>bf16</td></tr>"));
}

TEST(ReportTest, WhatTheServerSaysCannotAddMarkup) {
  v1::JobStatus s = SucceededJob();
  s.set_name("<script>alert(1)</script>");
  s.set_reason("\"><img src=x onerror=alert(2)>");
  s.mutable_spec()->mutable_model()->set_name("</pre><script>alert(3)</script>");
  const std::string html = RenderJobReport(s, History(3), kNow);
  EXPECT_THAT(html, Not(HasSubstr("<script")));
  EXPECT_THAT(html, Not(HasSubstr("<img")));
  EXPECT_THAT(html, HasSubstr("&lt;script&gt;alert(1)&lt;/script&gt;"));
  EXPECT_THAT(html, HasSubstr("&quot;&gt;&lt;img src=x onerror=alert(2)&gt;"));
  EXPECT_EQ(HtmlEscape("a&b<'\">"), "a&amp;b&lt;&#39;&quot;&gt;");
}

TEST(ReportTest, ARunningJobWithoutHistoryOrTestMetricsSaysSo) {
  v1::JobStatus s = SucceededJob();
  s.set_state(v1::JOB_STATE_RUNNING);
  s.clear_test();
  s.set_finished_unix_ms(0);
  const std::string html = RenderJobReport(s, v1::JobHistory(), kNow);
  EXPECT_THAT(html, HasSubstr("No training history was recorded"));
  EXPECT_THAT(html, HasSubstr("no points recorded"));
  EXPECT_THAT(html, HasSubstr("this job is RUNNING"));
  EXPECT_THAT(html, Not(HasSubstr("<svg id=\"confusion\"")));
  EXPECT_THAT(html, HasSubstr("running for"));
  EXPECT_THAT(html, HasSubstr("1 min 38 s"));  // kNow - started.
}

TEST(ReportTest, NonFinitePointsAreLeftOutAndOnePointIsStillDrawn) {
  v1::JobHistory h = History(4);
  h.mutable_points(1)->set_loss(std::numeric_limits<double>::quiet_NaN());
  h.mutable_points(2)->set_loss(std::numeric_limits<double>::infinity());
  const std::string html = RenderJobReport(SucceededJob(), h, kNow);
  EXPECT_EQ(PolylinePoints(html, "loss-plot").size(), 2u);
  EXPECT_EQ(PolylinePoints(html, "accuracy-plot").size(), 4u);
  EXPECT_THAT(html, Not(HasSubstr("nan")));
  EXPECT_THAT(html, Not(HasSubstr("inf\"")));

  const std::string one = RenderJobReport(SucceededJob(), History(1), kNow);
  EXPECT_EQ(PolylinePoints(one, "loss-plot").size(), 1u);
  EXPECT_THAT(one, HasSubstr("<circle"));
}

TEST(ReportTest, ManyClassesSkipTheHeatMapButKeepThePerClassTable) {
  v1::JobStatus s = SucceededJob();
  v1::EvalMetrics* t = s.mutable_test();
  t->clear_confusion();
  const int k = 100;
  t->set_num_classes(k);
  for (int r = 0; r < k; ++r) {
    for (int c = 0; c < k; ++c) t->add_confusion(r == c ? 3 : 0);
  }
  const std::string html = RenderJobReport(s, History(2), kNow);
  EXPECT_THAT(html, Not(HasSubstr("<svg id=\"confusion\"")));
  EXPECT_THAT(html, HasSubstr("100 classes: too many for a heat map"));
  EXPECT_THAT(html, HasSubstr("<tr><td>99</td><td>1.0000</td><td>1.0000</td><td>1.0000</td>"));
}

// A hostile or broken server's counts: huge ones cost O(k^2), not O(count).
TEST(ReportTest, MetricsFromProtoTakesHugeCountsAtOnce) {
  v1::EvalMetrics m;
  m.set_num_classes(2);
  for (int64_t n : {int64_t{1} << 40, int64_t{0}, int64_t{0}, int64_t{1} << 40}) {
    m.add_confusion(n);
  }
  const ClassificationMetrics metrics = MetricsFromProto(m);
  EXPECT_EQ(metrics.samples, int64_t{1} << 41);
  EXPECT_DOUBLE_EQ(metrics.accuracy, 1.0);
  // A matrix of the wrong size: the proto's own figures.
  m.add_confusion(1);
  m.set_accuracy(0.25);
  EXPECT_DOUBLE_EQ(MetricsFromProto(m).accuracy, 0.25);
}

}  // namespace
}  // namespace pstrain
