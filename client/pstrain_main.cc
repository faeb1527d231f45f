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
  auto from_env = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value != nullptr ? value : "");
  };
  env.server_env = from_env("PSTRAIN_SERVER");
  env.token_file_env = from_env("PSTRAIN_TOKEN_FILE");
  env.tls_ca_env = from_env("PSTRAIN_TLS_CA");
  env.tls_cert_env = from_env("PSTRAIN_TLS_CERT");
  env.tls_key_env = from_env("PSTRAIN_TLS_KEY");
  env.stdout_is_tty = isatty(STDOUT_FILENO) == 1;
  return pstrain::RunCli(std::vector<std::string>(argv + 1, argv + argc), env, std::cout,
                         std::cerr);
}
