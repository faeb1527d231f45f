// pstrain: the command-line client.
//
//   pstrain summary examples/fashion-mnist.json
#include <iostream>
#include <string>
#include <vector>

#include "client/summary.h"

namespace {

constexpr char kUsage[] =
    "usage: pstrain <command> [args]\n"
    "\n"
    "commands:\n"
    "  summary JOB.json   print the model's layers, output shapes and parameter counts\n"
    "  help               show this message\n"
    "\n"
    "Train a job on one machine with: pstrain-worker --standalone JOB.json\n";

int Summary(const std::vector<std::string>& args) {
  if (args.size() != 1 || args[0] == "--help" || args[0] == "-h") {
    std::cerr << "usage: pstrain summary JOB.json\n"
                 "  Validates the job's model and prints a table of layer, output shape and\n"
                 "  parameter count, plus the totals. Exits 2 if the model is invalid.\n";
    return args.size() == 1 ? 0 : 2;
  }
  auto table = pstrain::SummarizeJobFile(args[0]);
  if (!table.ok()) {
    std::cerr << "pstrain summary: error: " << table.status().message() << std::endl;
    return 2;
  }
  std::cout << *table;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "summary") return Summary(args);
  std::cerr << "pstrain: unknown command '" << command << "'\n\n" << kUsage;
  return 2;
}
