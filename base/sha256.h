// Sha256Hex: SHA-256 (FIPS 180-4) of a byte string, as 64 lowercase hex digits. For a digest that
// names a secret without revealing it (the job token's, in the coordinator's persisted state:
// docs/operations.md "Coordinator failover"); not for passwords. Any thread.
#ifndef MORPH_BASE_SHA256_H_
#define MORPH_BASE_SHA256_H_

#include <string>
#include <string_view>

namespace morph {

std::string Sha256Hex(std::string_view data);

}  // namespace morph

#endif  // MORPH_BASE_SHA256_H_
