#include "client/report.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli.h"
#include "common/job_state.h"

namespace pstrain {
namespace {

// Heat-map cells drawn at most: past this many classes the matrix is left to
// the per-class table (a 1000-class matrix would be a million rectangles).
constexpr int kMaxHeatMapClasses = 60;

// "CONSISTENCY_SYNC" -> "sync".
std::string EnumName(const std::string& name, absl::string_view prefix) {
  if (absl::string_view(name).substr(0, prefix.size()) == prefix) {
    return absl::AsciiStrToLower(name.substr(prefix.size()));
  }
  return name.empty() ? "unknown" : name;
}

std::string FormatSeconds(double seconds) {
  if (!(seconds >= 0)) return "-";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return absl::StrFormat("%.1f s", seconds);
  if (s < 3600) return absl::StrFormat("%d min %02d s", s / 60, s % 60);
  return absl::StrFormat("%d h %02d min", s / 3600, (s % 3600) / 60);
}

std::string FormatUnixMs(int64_t ms) {
  if (ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(ms), absl::UTCTimeZone());
}

// A number for SVG coordinates: one decimal, never "nan".
std::string Coord(double v) { return absl::StrFormat("%.1f", std::isfinite(v) ? v : 0.0); }

// Axis ticks at 1, 2 or 5 x 10^k covering [lo, hi] with about `count` steps.
std::vector<double> NiceTicks(double lo, double hi, int count) {
  const double span = hi - lo;
  if (!(span > 0) || !std::isfinite(span)) return {lo};
  const double raw = span / count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * magnitude;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
    if (ticks.size() > 50) break;
  }
  return ticks;
}

std::string TickLabel(double v, double step) {
  if (std::abs(v) >= 1e6 || (step >= 1 && std::abs(v) >= 1e4)) return absl::StrFormat("%.3g", v);
  if (step >= 1) return absl::StrFormat("%.0f", v);
  const int decimals = std::clamp(static_cast<int>(std::ceil(-std::log10(step))), 1, 6);
  return absl::StrFormat("%.*f", decimals, v);
}

struct Series {
  std::string id;     // The svg element's id.
  std::string title;  // Above the plot.
  std::string y_label;
  std::string color;
  std::function<double(const v1::HistoryPoint&)> value;
  bool unit_interval = false;  // Accuracy: the axis stays within [0, 1].
};

// One line plot of `series` over the history's steps. Points whose value is
// not finite are left out; a dashed line marks where each resumed run began.
std::string LinePlot(const Series& series, const v1::JobHistory& history) {
  constexpr double kWidth = 640, kHeight = 260;
  constexpr double kLeft = 64, kRight = 16, kTop = 28, kBottom = 40;
  std::vector<std::pair<double, double>> xy;
  for (const v1::HistoryPoint& p : history.points()) {
    const double y = series.value(p);
    if (std::isfinite(y)) xy.emplace_back(static_cast<double>(p.step()), y);
  }
  std::string svg = absl::StrFormat(
      "<svg id=\"%s\" class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
      "height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"%s\">\n"
      "<text x=\"%s\" y=\"18\" class=\"plot-title\">%s</text>\n",
      series.id, static_cast<int>(kWidth), static_cast<int>(kHeight), static_cast<int>(kWidth),
      static_cast<int>(kHeight), HtmlEscape(series.title), Coord(kLeft), HtmlEscape(series.title));
  if (xy.empty()) {
    absl::StrAppend(&svg, "<text x=\"", Coord(kWidth / 2), "\" y=\"", Coord(kHeight / 2),
                    "\" class=\"empty\" text-anchor=\"middle\">no points recorded</text>\n</svg>");
    return svg;
  }
  double x_lo = xy.front().first, x_hi = xy.back().first;
  double y_lo = std::numeric_limits<double>::infinity(), y_hi = -y_lo;
  for (const auto& [x, y] : xy) {
    y_lo = std::min(y_lo, y);
    y_hi = std::max(y_hi, y);
  }
  if (x_hi <= x_lo) x_hi = x_lo + 1;
  if (series.unit_interval) {
    y_lo = std::max(0.0, y_lo);
    y_hi = std::min(1.0, std::max(y_hi, y_lo));
  }
  if (y_hi - y_lo < 1e-9) {
    const double pad = std::max(std::abs(y_hi) * 0.05, 1e-3);
    y_lo -= pad;
    y_hi += pad;
  } else {
    const double pad = (y_hi - y_lo) * 0.05;
    y_lo -= pad;
    y_hi += pad;
  }
  if (series.unit_interval) {
    y_lo = std::max(0.0, y_lo);
    y_hi = std::min(1.0, y_hi);
  }
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - x_lo) / (x_hi - x_lo) * plot_w; };
  auto py = [&](double y) { return kTop + (y_hi - y) / (y_hi - y_lo) * plot_h; };

  // Frame, grid and ticks.
  absl::StrAppend(&svg, "<rect x=\"", Coord(kLeft), "\" y=\"", Coord(kTop), "\" width=\"",
                  Coord(plot_w), "\" height=\"", Coord(plot_h), "\" class=\"frame\"/>\n");
  const std::vector<double> y_ticks = NiceTicks(y_lo, y_hi, 5);
  const double y_step = y_ticks.size() > 1 ? y_ticks[1] - y_ticks[0] : 1;
  for (double t : y_ticks) {
    if (t < y_lo || t > y_hi) continue;
    absl::StrAppend(&svg, "<line x1=\"", Coord(kLeft), "\" x2=\"", Coord(kLeft + plot_w),
                    "\" y1=\"", Coord(py(t)), "\" y2=\"", Coord(py(t)), "\" class=\"grid\"/>",
                    "<text x=\"", Coord(kLeft - 6), "\" y=\"", Coord(py(t) + 4),
                    "\" class=\"tick\" text-anchor=\"end\">", TickLabel(t, y_step), "</text>\n");
  }
  const std::vector<double> x_ticks = NiceTicks(x_lo, x_hi, 6);
  const double x_step = x_ticks.size() > 1 ? x_ticks[1] - x_ticks[0] : 1;
  for (double t : x_ticks) {
    if (t < x_lo || t > x_hi) continue;
    absl::StrAppend(&svg, "<text x=\"", Coord(px(t)), "\" y=\"", Coord(kTop + plot_h + 16),
                    "\" class=\"tick\" text-anchor=\"middle\">", TickLabel(t, x_step), "</text>\n");
  }
  absl::StrAppend(&svg, "<text x=\"", Coord(kLeft + plot_w / 2), "\" y=\"", Coord(kHeight - 6),
                  "\" class=\"axis\" text-anchor=\"middle\">step</text>\n", "<text x=\"14\" y=\"",
                  Coord(kTop + plot_h / 2), "\" class=\"axis\" text-anchor=\"middle\" ",
                  "transform=\"rotate(-90 14 ", Coord(kTop + plot_h / 2), ")\">",
                  HtmlEscape(series.y_label), "</text>\n");
  // Where a resumed run took over.
  for (int i = 1; i < history.points_size(); ++i) {
    const v1::HistoryPoint& p = history.points(i);
    if (p.run() == history.points(i - 1).run()) continue;
    const double x = px(static_cast<double>(history.points(i - 1).step()));
    absl::StrAppend(&svg, "<line x1=\"", Coord(x), "\" x2=\"", Coord(x), "\" y1=\"", Coord(kTop),
                    "\" y2=\"", Coord(kTop + plot_h), "\" class=\"run\"/><text x=\"", Coord(x + 3),
                    "\" y=\"", Coord(kTop + 12), "\" class=\"tick\">run ", p.run(), "</text>\n");
  }
  std::vector<std::string> points;
  points.reserve(xy.size());
  for (const auto& [x, y] : xy) points.push_back(absl::StrCat(Coord(px(x)), ",", Coord(py(y))));
  absl::StrAppend(&svg, "<polyline class=\"series\" fill=\"none\" stroke=\"", series.color,
                  "\" stroke-width=\"2\" points=\"", absl::StrJoin(points, " "), "\"/>\n");
  if (xy.size() == 1) {
    absl::StrAppend(&svg, "<circle cx=\"", Coord(px(xy[0].first)), "\" cy=\"",
                    Coord(py(xy[0].second)), "\" r=\"3\" fill=\"", series.color, "\"/>\n");
  }
  absl::StrAppend(&svg, "</svg>");
  return svg;
}

// Blues, from white (0) to dark blue (1).
std::string HeatColor(double f) {
  f = std::clamp(std::isfinite(f) ? f : 0.0, 0.0, 1.0);
  const double lo[3] = {247, 251, 255}, hi[3] = {8, 48, 107};
  int c[3];
  for (int i = 0; i < 3; ++i) c[i] = static_cast<int>(std::lround(lo[i] + (hi[i] - lo[i]) * f));
  return absl::StrFormat("#%02x%02x%02x", c[0], c[1], c[2]);
}

// The confusion matrix: rows are true classes, columns predictions; a cell's
// shade is its share of its row, its text the count.
std::string HeatMap(const ClassificationMetrics& m) {
  const int k = m.num_classes;
  const double cell = std::clamp(480.0 / k, 12.0, 40.0);
  constexpr double kLeft = 70, kTop = 56;
  const double size = cell * k;
  const double width = kLeft + size + 16, height = kTop + size + 16;
  std::string svg = absl::StrFormat(
      "<svg id=\"confusion\" class=\"heatmap\" xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"%s\" height=\"%s\" viewBox=\"0 0 %s %s\" role=\"img\" "
      "aria-label=\"confusion matrix\">\n"
      "<text x=\"%s\" y=\"16\" class=\"axis\" text-anchor=\"middle\">predicted</text>\n"
      "<text x=\"16\" y=\"%s\" class=\"axis\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 16 %s)\">true</text>\n",
      Coord(width), Coord(height), Coord(width), Coord(height), Coord(kLeft + size / 2),
      Coord(kTop + size / 2), Coord(kTop + size / 2));
  const bool text = cell >= 24;
  for (int c = 0; c < k; ++c) {
    absl::StrAppend(&svg, "<text x=\"", Coord(kLeft + (c + 0.5) * cell), "\" y=\"", Coord(kTop - 8),
                    "\" class=\"tick\" text-anchor=\"middle\">", c, "</text>", "<text x=\"",
                    Coord(kLeft - 8), "\" y=\"", Coord(kTop + (c + 0.5) * cell + 4),
                    "\" class=\"tick\" text-anchor=\"end\">", c, "</text>\n");
  }
  for (int t = 0; t < k; ++t) {
    int64_t row_total = 0;
    for (int p = 0; p < k; ++p) row_total += m.confusion[static_cast<size_t>(t) * k + p];
    for (int p = 0; p < k; ++p) {
      const int64_t n = m.confusion[static_cast<size_t>(t) * k + p];
      const double f = row_total > 0 ? static_cast<double>(n) / static_cast<double>(row_total) : 0;
      absl::StrAppend(&svg, "<rect class=\"cell\" x=\"", Coord(kLeft + p * cell), "\" y=\"",
                      Coord(kTop + t * cell), "\" width=\"", Coord(cell), "\" height=\"",
                      Coord(cell), "\" fill=\"", HeatColor(f), "\"><title>true ", t, ", predicted ",
                      p, ": ", n, "</title></rect>");
      if (text && n > 0) {
        absl::StrAppend(&svg, "<text x=\"", Coord(kLeft + (p + 0.5) * cell), "\" y=\"",
                        Coord(kTop + (t + 0.5) * cell + 4), "\" class=\"count\" fill=\"",
                        f > 0.5 ? "#ffffff" : "#111111", "\" text-anchor=\"middle\">", n,
                        "</text>");
      }
    }
    absl::StrAppend(&svg, "\n");
  }
  absl::StrAppend(&svg, "</svg>");
  return svg;
}

std::string Row(const std::string& name, const std::string& value) {
  return absl::StrCat("<tr><th>", HtmlEscape(name), "</th><td>", HtmlEscape(value), "</td></tr>\n");
}

std::string Percent(double v) { return absl::StrFormat("%.2f%%", 100 * v); }

constexpr char kStyle[] = R"(
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1b1b;
       margin: 24px auto; max-width: 1340px; padding: 0 20px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 10px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.state { font-size: 13px; padding: 2px 8px; border-radius: 10px; color: #fff; background: #666;
         vertical-align: middle; }
.state.SUCCEEDED { background: #2e7d32; } .state.FAILED { background: #c62828; }
.state.RUNNING { background: #1565c0; } .state.CANCELLED { background: #6d4c41; }
.reason { color: #444; margin: 4px 0 16px; }
table { border-collapse: collapse; }
table.facts th { text-align: left; font-weight: 600; padding: 2px 16px 2px 0; color: #333; }
table.facts td { padding: 2px 0; }
table.perclass th, table.perclass td { padding: 3px 12px; border-bottom: 1px solid #eee;
                                       text-align: right; }
table.perclass th:first-child, table.perclass td:first-child { text-align: left; }
.grid2 { display: flex; flex-wrap: wrap; gap: 16px 24px; }
.plot .frame { fill: #fff; stroke: #999; } .plot .grid { stroke: #e5e5e5; }
.plot .run { stroke: #888; stroke-dasharray: 4 3; }
.plot-title { font-weight: 600; font-size: 13px; } .tick { font-size: 11px; fill: #444; }
.axis { font-size: 12px; fill: #222; } .empty { fill: #777; font-size: 13px; }
.count { font-size: 11px; } .heatmap .cell { stroke: #fff; stroke-width: 1; }
.metrics td { font-size: 18px; padding-right: 28px; } .metrics th { font-weight: 400;
  color: #555; text-align: left; padding-right: 28px; }
pre { background: #f6f8fa; padding: 12px; overflow: auto; font-size: 12px; max-height: 520px; }
footer { margin-top: 32px; color: #777; font-size: 12px; }
)";

}  // namespace

std::string HtmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string RenderJobReport(const v1::JobStatus& status, const v1::JobHistory& history,
                            absl::Time now) {
  const v1::JobSpec& spec = status.spec();
  const std::string state = JobStateName(status.state());
  std::string title = status.job_id();
  if (!status.name().empty()) absl::StrAppend(&title, " \xC2\xB7 ", status.name());

  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
      "<meta name=\"generator\" content=\"pstrain\">\n<title>", HtmlEscape(title), " (", state,
      ")</title>\n<style>", kStyle, "</style>\n</head>\n<body>\n<h1>", HtmlEscape(title),
      " <span class=\"state ", state, "\">", state, "</span></h1>\n");
  if (!status.reason().empty()) {
    absl::StrAppend(&html, "<p class=\"reason\">", HtmlEscape(status.reason()), "</p>\n");
  }

  // The job at a glance.
  const double queued_s =
      status.started_unix_ms() > 0
          ? (status.started_unix_ms() - status.submitted_unix_ms()) / 1000.0
          : absl::ToDoubleSeconds(now - absl::FromUnixMillis(status.submitted_unix_ms()));
  const int64_t end_ms =
      status.finished_unix_ms() > 0 ? status.finished_unix_ms() : absl::ToUnixMillis(now);
  const double ran_s =
      status.started_unix_ms() > 0 ? (end_ms - status.started_unix_ms()) / 1000.0 : -1;
  std::string facts;
  absl::StrAppend(
      &facts,
      Row("model", absl::StrCat(spec.model().name().empty() ? "(unnamed)" : spec.model().name(),
                                ", ", spec.model().layers_size(), " layers")),
      Row("dataset", EnumName(v1::DatasetFormat_Name(spec.dataset().format()), "DATASET_FORMAT_") +
                         (spec.dataset().path().empty() ? "" : " " + spec.dataset().path())),
      Row("mode", EnumName(v1::ConsistencyMode_Name(spec.mode()), "CONSISTENCY_")),
      Row("precision", EnumName(v1::Precision_Name(spec.precision()), "PRECISION_")),
      Row("workers", absl::StrCat(std::max(1, spec.workers()), " wanted",
                                  status.workers_size() > 0
                                      ? absl::StrCat("; ", absl::StrJoin(status.workers(), ", "))
                                      : "")),
      Row("optimizer",
          absl::StrCat(EnumName(v1::OptimizerType_Name(spec.optimizer().type()), "OPTIMIZER_"),
                       ", learning rate ", spec.optimizer().learning_rate())),
      Row("epochs", absl::StrCat(status.epoch(), " of ", spec.epochs(), " done; batch ",
                                 spec.batch_size(), " per worker")),
      Row("steps", status.total_steps() > 0
                       ? absl::StrCat(status.step(), " of ", status.total_steps())
                       : absl::StrCat(status.step())),
      Row("submitted", FormatUnixMs(status.submitted_unix_ms())),
      Row("started", absl::StrCat(FormatUnixMs(status.started_unix_ms()), " (queued ",
                                  FormatSeconds(queued_s), ")")),
      Row(status.finished_unix_ms() > 0 ? "finished" : "running for",
          status.finished_unix_ms() > 0 ? absl::StrCat(FormatUnixMs(status.finished_unix_ms()),
                                                       " (ran ", FormatSeconds(ran_s), ")")
                                        : FormatSeconds(ran_s)));
  if (ran_s > 0 && status.step() > 0) {
    absl::StrAppend(&facts, Row("throughput", absl::StrFormat("%.2f steps/s over the run",
                                                              status.step() / ran_s)));
  }
  if (status.runs() > 1 || status.workers_lost() > 0) {
    absl::StrAppend(
        &facts, Row("recovery",
                    absl::StrCat(status.runs(), " runs, ", status.workers_lost(), " workers lost, ",
                                 status.steps_lost(), " steps trained again")));
  }
  absl::StrAppend(&html, "<section id=\"job\">\n<table class=\"facts\">\n", facts,
                  "</table>\n</section>\n");

  // Training curves.
  const std::vector<Series> series = {
      {"loss-plot", "training loss", "loss", "#d62728",
       [](const v1::HistoryPoint& p) { return p.loss(); }},
      {"accuracy-plot", "training accuracy", "accuracy", "#1f77b4",
       [](const v1::HistoryPoint& p) { return p.train_accuracy(); }, true},
      {"throughput-plot", "throughput (all workers)", "samples/s", "#2ca02c",
       [](const v1::HistoryPoint& p) { return p.samples_per_sec(); }}};
  absl::StrAppend(&html, "<section id=\"training\">\n<h2>Training</h2>\n");
  if (history.points_size() == 0) {
    absl::StrAppend(&html, "<p class=\"empty\">No training history was recorded for this job ",
                    "(it has not reported progress yet, or it ran on a server without "
                    "history).</p>\n");
  }
  absl::StrAppend(&html, "<div class=\"grid2\">\n");
  for (const Series& s : series) absl::StrAppend(&html, LinePlot(s, history), "\n");
  absl::StrAppend(&html, "</div>\n<p class=\"tick\">", history.points_size(),
                  " points; the mean over the workers' progress reports",
                  history.min_step_gap() > 1
                      ? absl::StrCat(", at least ", history.min_step_gap(), " steps apart")
                      : std::string(),
                  ".</p>\n</section>\n");

  // Test metrics.
  absl::StrAppend(&html, "<section id=\"test\">\n<h2>Test set</h2>\n");
  if (status.state() == v1::JOB_STATE_SUCCEEDED && status.has_test()) {
    const ClassificationMetrics m = MetricsFromProto(status.test());
    absl::StrAppend(
        &html, "<table class=\"metrics\"><tr><th>accuracy</th><th>macro precision</th>",
        "<th>macro recall</th><th>macro F1</th><th>loss</th><th>samples</th></tr>\n<tr><td>",
        Percent(m.accuracy), "</td><td>", absl::StrFormat("%.4f", m.macro_precision), "</td><td>",
        absl::StrFormat("%.4f", m.macro_recall), "</td><td>", absl::StrFormat("%.4f", m.macro_f1),
        "</td><td>", absl::StrFormat("%.4f", m.loss), "</td><td>", m.samples,
        "</td></tr></table>\n");
    const int k = m.num_classes;
    if (k > 0 && m.confusion.size() == static_cast<size_t>(k) * k) {
      absl::StrAppend(&html, "<div class=\"grid2\">\n<div>\n<h3>Confusion matrix</h3>\n");
      if (k <= kMaxHeatMapClasses) {
        absl::StrAppend(&html, HeatMap(m), "\n<p class=\"tick\">Rows: true class; columns: ",
                        "predicted. A cell's shade is its share of the row.</p>\n");
      } else {
        absl::StrAppend(&html, "<p class=\"empty\">", k, " classes: too many for a heat map; ",
                        "see the per-class table.</p>\n");
      }
      absl::StrAppend(&html, "</div>\n<div>\n<h3>Per class</h3>\n<table id=\"per-class\" ",
                      "class=\"perclass\">\n<tr><th>class</th><th>precision</th><th>recall</th>"
                      "<th>F1</th><th>support</th></tr>\n");
      const bool named = m.class_names.size() == static_cast<size_t>(k);
      for (int c = 0; c < k; ++c) {
        int64_t support = 0;
        for (int p = 0; p < k; ++p) support += m.confusion[static_cast<size_t>(c) * k + p];
        // A named class shows "3 ROBE" (the dataset's name, escaped).
        const std::string label =
            named ? absl::StrCat(c, " ", HtmlEscape(m.class_names[c])) : absl::StrCat(c);
        absl::StrAppend(&html, absl::StrFormat("<tr><td>%s</td><td>%.4f</td><td>%.4f</td>"
                                               "<td>%.4f</td><td>%d</td></tr>\n",
                                               label, m.per_class_precision[c],
                                               m.per_class_recall[c], m.per_class_f1[c], support));
      }
      absl::StrAppend(&html, "</table>\n</div>\n</div>\n");
    }
  } else {
    absl::StrAppend(&html, "<p class=\"empty\">The test set is evaluated once the job has ",
                    "trained every epoch; this job is ", state, ".</p>\n");
  }
  absl::StrAppend(&html, "</section>\n");

  // The spec, as it can be submitted again.
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(spec, &json, options).ok()) {
    json = "(the spec could not be printed)";
  }
  absl::StrAppend(&html, "<section id=\"spec\">\n<h2>Job spec</h2>\n<pre>", HtmlEscape(json),
                  "</pre>\n</section>\n<footer>Written by pstrain at ",
                  absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", now, absl::UTCTimeZone()),
                  ".</footer>\n</body>\n</html>\n");
  return html;
}

}  // namespace pstrain
