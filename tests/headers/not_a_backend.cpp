// Must not compile: a backend without all_to_all (and more) is not a weft::backend.
#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>

struct incomplete_backend {
  static constexpr std::string_view name = "incomplete";
  struct request {
    void wait() {}
    bool test() { return true; }
  };
  struct comm {
    int rank() const { return 0; }
    int size() const { return 1; }
  };
};

int main() {
  weft::communicator<incomplete_backend>* c = nullptr;
  (void)c;
}
