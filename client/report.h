// The job report: one self-contained HTML page (`pstrain report JOB -o
// F.html`, `pstrain status JOB --report F.html`) that a data scientist can
// open, mail or archive. No script, no external resource: inline CSS and SVG.
//
//   - the job: state, reason, model, dataset, mode, workers, timing, runs;
//   - the training curves over steps (loss, train accuracy, samples/s) from
//     the job's history (v1::JobHistory), with each resumed run marked;
//   - once it SUCCEEDED: the test metrics, the confusion matrix as a heat map
//     (each row shaded by its share of the true class) and per-class
//     precision, recall, F1 and support;
//   - the spec as accepted, as proto3 JSON (it can be submitted again).
//
// Every string that came from the server is escaped: a job name or reason
// cannot add markup.
#ifndef PSTRAIN_CLIENT_REPORT_H_
#define PSTRAIN_CLIENT_REPORT_H_

#include <string>

#include "absl/time/time.h"
#include "common/eval_metrics.h"  // MetricsFromProto, used by the page.
#include "common/metrics.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// The page for `status` and `history`; `now` is the time it says it was
// written at (and the end of a job that is still running).
std::string RenderJobReport(const v1::JobStatus& status, const v1::JobHistory& history,
                            absl::Time now);

// &, <, >, " and ' as entities.
std::string HtmlEscape(const std::string& text);

}  // namespace pstrain

#endif  // PSTRAIN_CLIENT_REPORT_H_
