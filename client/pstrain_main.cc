// pstrain: the command-line client (see client/cli.h for the commands).
//
//   pstrain --server 127.0.0.1:7070 submit examples/fashion-mnist.json --workers 2 --watch
//   pstrain status job-1 --json
//   pstrain summary examples/fashion-mnist.json
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  pstrain::CliEnvironment env;
  if (const char* server = std::getenv("PSTRAIN_SERVER")) env.server_env = server;
  env.stdout_is_tty = isatty(STDOUT_FILENO) == 1;
  return pstrain::RunCli(std::vector<std::string>(argv + 1, argv + argc), env, std::cout,
                         std::cerr);
}
