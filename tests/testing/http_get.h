// A minimal HTTP/1.1 GET against 127.0.0.1 for tests of /metrics endpoints.
//
//   std::string response = pstrain::testing::HttpGet(port, "/metrics");
#ifndef PSTRAIN_TESTS_TESTING_HTTP_GET_H_
#define PSTRAIN_TESTS_TESTING_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace pstrain::testing {

// The whole HTTP response to "GET path" (headers and body), "" when the
// connection is refused. Reads until the server closes the connection.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, request.data(), request.size(), 0);
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  close(fd);
  return response;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_HTTP_GET_H_
