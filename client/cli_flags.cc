// The CLI's command-line parser over Abseil flags, the --help option lists
// and the --json printer. absl::ParseCommandLine is not used: it exits the
// process on an error and parses one global line, while RunCli parses one
// command's line at a time, in-process, many times.
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/cli_internal.h"

namespace pstrain::cli_internal {
namespace {

// How a flag is spelled on the command line: --timeout-ms for timeout_ms.
std::string Spelling(absl::string_view name) {
  return absl::StrCat("--", absl::StrReplaceAll(name, {{"_", "-"}}));
}

// "VALUE" in "--name VALUE": N for numbers, a word for what the value is
// where the flag's name does not say it, else the upper-cased name.
std::string Placeholder(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<int>() || flag.IsOfType<std::optional<int>>() ||
      flag.IsOfType<std::optional<int64_t>>()) {
    return "N";
  }
  static const auto* kPlaceholders =
      new std::map<absl::string_view, absl::string_view>{{"server", "HOST:PORT"},
                                                         {"tls_ca", "FILE"},
                                                         {"tls_cert", "FILE"},
                                                         {"tls_key", "FILE"},
                                                         {"token_file", "FILE"},
                                                         {"tls_server_name", "NAME"},
                                                         {"output", "FILE"},
                                                         {"report", "FILE.html"},
                                                         {"compression", "METHOD"},
                                                         {"pull_compression", "METHOD"},
                                                         {"precision", "fp32|bf16|fp16"},
                                                         {"image_size", "HxW"},
                                                         {"path", "SRC"},
                                                         {"service", "NAME"}};
  auto it = kPlaceholders->find(flag.Name());
  if (it != kPlaceholders->end()) return std::string(it->second);
  return absl::AsciiStrToUpper(absl::StrReplaceAll(flag.Name(), {{"_", "-"}}));
}

// Appends `text` to `out` in lines of at most kWidth columns, the first
// starting at column `column`, the others indented to `indent`.
void AppendWrapped(absl::string_view text, size_t column, size_t indent, std::string* out) {
  constexpr size_t kWidth = 80;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > indent && column + 1 + word.size() > kWidth) {
      absl::StrAppend(out, "\n", std::string(indent, ' '));
      column = indent;
    } else if (column > indent) {
      absl::StrAppend(out, " ");
      ++column;
    }
    absl::StrAppend(out, word);
    column += word.size();
  }
  absl::StrAppend(out, "\n");
}

bool IsZero(const absl::CommandLineFlag& flag) {
  const std::string value = flag.DefaultValue();
  return value.empty() || value == "false" || value == "0";
}

// The flag of `flags` that `name` (without its dashes) spells, else nullptr.
absl::CommandLineFlag* Lookup(absl::string_view name,
                              absl::Span<const absl::CommandLineFlag* const> flags) {
  std::string canonical = absl::StrReplaceAll(name, {{"-", "_"}});
  if (canonical == "o") canonical = "output";
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(canonical);
  if (flag == nullptr || std::find(flags.begin(), flags.end(), flag) == flags.end()) {
    return nullptr;
  }
  return flag;
}

}  // namespace

absl::Mutex& FlagsMutex() {
  static absl::Mutex* mu = new absl::Mutex;
  return *mu;
}

const absl::CommandLineFlag* FindOption(absl::string_view arg,
                                        absl::Span<const absl::CommandLineFlag* const> flags) {
  if (arg.size() < 2 || arg[0] != '-') return nullptr;
  absl::string_view name = absl::StripPrefix(absl::StripPrefix(arg, "-"), "-");
  return Lookup(name.substr(0, name.find('=')), flags);
}

absl::StatusOr<CommandLine> ParseFlags(const std::vector<std::string>& args,
                                       absl::Span<const absl::CommandLineFlag* const> flags) {
  // Every call starts from the defaults. (absl::FlagSaver would restore the
  // values after a call instead, but in Abseil 20220623 it logs every flag it
  // restores to stderr, the CLI's error output.)
  for (const absl::CommandLineFlag* known : flags) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(known->Name());
    std::string error;
    if (!flag->ParseFrom(flag->DefaultValue(), &error)) {
      return absl::InternalError(
          absl::StrCat("cannot reset ", Spelling(flag->Name()), ": ", error));
    }
  }
  CommandLine line;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      line.help = true;
      continue;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      line.positional.push_back(arg);
      continue;
    }
    absl::string_view name = absl::StripPrefix(absl::StripPrefix(arg, "-"), "-");
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != absl::string_view::npos) {
      value = std::string(name.substr(eq + 1));
      name = name.substr(0, eq);
    }
    absl::CommandLineFlag* flag = Lookup(name, flags);
    if (flag == nullptr && !value && absl::StartsWith(name, "no")) {
      // --nowatch (or --no-watch) for a bool flag.
      flag = Lookup(absl::StripPrefix(absl::StripPrefix(name, "no"), "-"), flags);
      if (flag != nullptr && !flag->IsOfType<bool>()) flag = nullptr;
      if (flag != nullptr) value = "false";
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option '", arg, "'"));
    }
    const std::string spelling = Spelling(flag->Name());
    if (!value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat(spelling, " needs a value"));
      }
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(spelling, ": '", *value, "' is not a valid ",
                       flag->IsOfType<bool>() ? "true or false" : Placeholder(*flag)));
    }
  }
  return line;
}

std::string FlagsHelp(absl::Span<const absl::CommandLineFlag* const> flags) {
  constexpr size_t kIndent = 28;  // Where the help texts start.
  std::string help;
  for (const absl::CommandLineFlag* flag : flags) {
    std::string synopsis = absl::StrCat("  ", Spelling(flag->Name()));
    if (flag->Name() == "output") synopsis = "  -o, --output";
    if (!flag->IsOfType<bool>()) absl::StrAppend(&synopsis, " ", Placeholder(*flag));
    absl::StrAppend(&help, synopsis);
    if (synopsis.size() + 1 >= kIndent) absl::StrAppend(&help, "\n");
    const size_t column = synopsis.size() + 1 >= kIndent ? 0 : synopsis.size();
    absl::StrAppend(&help, std::string(kIndent - column, ' '));
    std::string text = flag->Help();
    if (!IsZero(*flag)) absl::StrAppend(&text, " (default: ", flag->DefaultValue(), ")");
    AppendWrapped(text, kIndent, kIndent, &help);
  }
  return help;
}

absl::StatusOr<std::string> ProtoJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.add_whitespace = false;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) return absl::InternalError(status.ToString());
  return json;
}

}  // namespace pstrain::cli_internal
